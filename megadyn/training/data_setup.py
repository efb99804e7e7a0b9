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
)
from megadyn.training.config import MegadynConfig


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
