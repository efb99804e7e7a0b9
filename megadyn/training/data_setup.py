"""From DataConfig to a tokenizer, datasets and this data-parallel rank's loaders.

Under --sample-per-document the datasets hold one document per sample and the loader is a
`TokenBudgetLoader` (micro batches by --micro-batch-tokens, whole steps at a time).

The loaders are cheap to rebuild: a reconfiguration that changes dp builds new ones at the same
data cursor (`consumed_samples`, counted over all ranks), so no sample is lost or repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megadyn.data import (
    DocumentMasking,
    MicroBatchLoader,
    TokenBudgetLoader,
    build_gpt_datasets,
    build_tokenizer,
    parse_data_path,
)
from megadyn.data.indexed_dataset import bin_path
from megadyn.data.token_range import token_range
from megadyn.training.config import ConfigError, DataConfig, MegadynConfig

VOCABULARY_FLAGS = {
    "NullTokenizer": "--vocab-size",
    "GPT2BPETokenizer": "--vocab-file",
}
"""The flag that sets each tokenizer's vocabulary (--tokenizer-model for the others)."""


@dataclass
class Datasets:
    tokenizer: object
    train: object
    valid: object | None
    documents: DocumentMasking | None = None
    """What the loaders do to each micro batch under the document flags (None: nothing)."""


def build_datasets(cfg: MegadynConfig, group=None) -> Datasets:
    """Tokenizer and datasets; rank 0 of `group` builds index caches first, the rest reuse them
    (`group=None`: build without waiting for anyone)."""
    d, t = cfg.data, cfg.training
    tokenizer = build_tokenizer(
        d.tokenizer_type or "NullTokenizer",
        tokenizer_model=d.tokenizer_model,
        vocab_file=d.vocab_file,
        merge_file=d.merge_file,
        vocab_size=d.vocab_size or (cfg.model.vocab_size - 1),
    )
    iters = t.train_iters
    gbs = t.global_batch_size
    eval_rounds = iters // t.eval_interval + 1 if t.eval_interval else 0
    valid_samples = eval_rounds * t.eval_iters * gbs if t.eval_iters else 0
    num_samples = (t.train_samples or iters * gbs, valid_samples, 0)

    def build():
        if not d.mock_data:
            check_token_ids(d, tokenizer.vocab_size)
        return build_gpt_datasets(
            list(d.data_path) if d.data_path else None,
            d.split,
            d.seq_length,
            t.seed,
            num_samples,
            d.data_cache_path,
            tokenizer.eod,
            mock=d.mock_data,
            vocab_size=tokenizer.vocab_size,
            sample_per_document=d.sample_per_document,
        )

    if group is None:  # no collective: caches exist already (a process joining a running job)
        train, valid, _ = build()
    else:
        if dist.get_rank(group) == 0:
            train, valid, _ = build()
        dist.barrier(group=group)
        if dist.get_rank(group) != 0:
            train, valid, _ = build()
    if train is None:
        raise ValueError("--split leaves no training data; give the first --split part a weight")
    documents = DocumentMasking(
        tokenizer.eod, cfg.model.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss
    )
    return Datasets(tokenizer, train, valid, documents if documents.active else None)


def check_token_ids(data: DataConfig, vocab_size: int) -> None:
    """Every token id of every --data-path file lies in [0, vocab_size): else a ConfigError
    naming the file, its largest id, the vocabulary and the flag that sets it (before the
    first step's embedding lookup fails). Each .bin is scanned once (token_range.py)."""
    for prefix in parse_data_path(data.data_path)[0]:
        found = token_range(prefix)
        if found is None or (found[0] >= 0 and found[1] < vocab_size):
            continue
        tokenizer = data.tokenizer_type or "NullTokenizer"
        flag = VOCABULARY_FLAGS.get(tokenizer, "--tokenizer-model")
        if found[0] < 0:
            raise ConfigError(f"--data-path {bin_path(prefix)}: negative token id {found[0]}")
        advice = (
            f"give --vocab-size {found[1]} or more" if tokenizer == "NullTokenizer"
            else f"give the {flag} the data was tokenized with"
        )  # fmt: skip
        raise ConfigError(
            f"--data-path {bin_path(prefix)}: token id {found[1]} is beyond the vocabulary of "
            f"{vocab_size} tokens of --tokenizer-type {tokenizer} ({flag}); the data was "
            f"tokenized with a larger vocabulary: {advice}, or tokenize it again with "
            "tools/preprocess_data.py"
        )


def build_loader(
    dataset,
    cfg: MegadynConfig,
    dp_rank: int,
    dp_size: int,
    consumed: int,
    documents: DocumentMasking | None = None,
) -> MicroBatchLoader | TokenBudgetLoader:
    cursor = dict(consumed_samples=consumed, seed=cfg.training.seed, transform=documents)
    if cfg.training.micro_batch_tokens is not None:
        budget = cfg.training.micro_batch_tokens
        return TokenBudgetLoader(dataset, budget, dp_rank, dp_size, **cursor)
    size, workers = cfg.training.micro_batch_size, cfg.data.num_workers
    return MicroBatchLoader(dataset, size, dp_rank, dp_size, num_workers=workers, **cursor)
