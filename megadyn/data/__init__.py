"""Data for megadyn: Megatron-compatible indexed datasets, tokenizers, GPT datasets, blending,
and the sampler / loader whose order survives changes of data-parallel size (DESIGN.md §6).

This package imports nothing else from megadyn; the trainer hands it dp_rank / dp_size as ints.
"""

from megadyn.data.blended_dataset import BlendedDataset, parse_data_path
from megadyn.data.default_corpus import prepare_default_data
from megadyn.data.document_dataset import DocumentDataset
from megadyn.data.documents import DocumentMasking
from megadyn.data.gpt_dataset import GPTDataset, build_gpt_datasets, parse_split
from megadyn.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    optimal_dtype,
)
from megadyn.data.loader import MicroBatchLoader, collate
from megadyn.data.mock_dataset import MockGPTDataset
from megadyn.data.preprocess import PreprocessError, preprocess_data
from megadyn.data.sampler import GlobalSampleOrder, micro_batch_indices
from megadyn.data.token_budget import StepBatches, TokenBudgetLoader, step_share
from megadyn.data.tokenizers import TOKENIZER_TYPES, build_tokenizer

__all__ = [
    "TOKENIZER_TYPES",
    "BlendedDataset",
    "DocumentDataset",
    "DocumentMasking",
    "GPTDataset",
    "GlobalSampleOrder",
    "IndexedDataset",
    "IndexedDatasetError",
    "IndexedDatasetWriter",
    "MicroBatchLoader",
    "MockGPTDataset",
    "PreprocessError",
    "StepBatches",
    "TokenBudgetLoader",
    "build_gpt_datasets",
    "build_tokenizer",
    "collate",
    "micro_batch_indices",
    "optimal_dtype",
    "parse_data_path",
    "parse_split",
    "prepare_default_data",
    "preprocess_data",
    "step_share",
]
