"""One document per sample and micro batches by token budget: every document of an epoch is
read once (cut at --seq-length), across dp changes and a resume, and no micro batch holds more
tokens than its budget."""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import make_indexed

from megadyn.data.document_dataset import DocumentDataset
from megadyn.data.indexed_dataset import IndexedDataset
from megadyn.data.token_budget import TokenBudgetLoader, group_by_tokens, step_share

SEQ, GLOBAL_BATCH = 16, 8  # 8 splits over dp 1, 2, 4; 5 steps are one epoch of 40
LENGTHS = [37, 5, 1, 17, 16, 9, 120, 2, 33, 0, 8, 64] * 4  # 8 of them (1s and 0s) are too short


@pytest.fixture
def corpus(tmp_path):
    docs = make_indexed(str(tmp_path / "d"), LENGTHS)
    return docs, DocumentDataset(IndexedDataset(str(tmp_path / "d")), np.arange(48), SEQ, seed=3)


def test_a_sample_is_one_document_cut_at_seq_length(corpus):
    docs, ds = corpus
    assert len(ds) == sum(n >= 2 for n in LENGTHS) == 40
    for i in range(len(ds)):
        sample, doc = ds[i], docs[int(ds.documents[i])]
        length = min(len(doc), SEQ + 1) - 1  # 37 tokens -> 16 inputs; 5 tokens -> 4 inputs
        assert len(sample["tokens"]) == ds.sample_length(i) == length
        assert sample["tokens"].tolist() == doc[:length].tolist()
        assert sample["labels"].tolist() == doc[1 : length + 1].tolist()


def test_grouping_respects_the_budget_and_keeps_every_sample():
    rng = np.random.default_rng(0)
    for budget in (16, 40, 100):
        lengths = [int(x) for x in rng.integers(1, 17, 30)]
        groups = group_by_tokens(lengths, budget)
        assert sorted(i for g in groups for i in g) == list(range(30))
        assert all(len(g) * max(lengths[i] for i in g) <= budget for g in groups)
    with pytest.raises(ValueError, match="--micro-batch-tokens"):
        group_by_tokens([8, 17], 16)


def padded(lengths, groups) -> int:
    return sum(len(g) * max(lengths[i] for i in g) for g in groups)


def test_grouping_takes_the_fewest_micro_batches_and_then_the_least_padding():
    """Against every way to cut the sorted samples into runs (small cases): no cut within the
    budget has fewer groups, or as many groups and fewer padded tokens; filling greedily
    pads short samples up to the long one they follow."""
    from itertools import combinations

    rng = np.random.default_rng(1)
    for _ in range(60):
        n, budget = int(rng.integers(1, 9)), int(rng.integers(16, 64))
        lengths = [int(x) for x in rng.integers(1, 17, n)]
        order = sorted(range(n), key=lambda i: (-lengths[i], i))
        best = None
        for k in range(n):
            for cuts in combinations(range(1, n), k):
                bounds = [0, *cuts, n]
                runs = [order[a:b] for a, b in zip(bounds, bounds[1:])]
                if all(len(r) * lengths[r[0]] <= budget for r in runs):
                    best = min(best or (n + 1, 0), (len(runs), padded(lengths, runs)))
        groups = group_by_tokens(lengths, budget)
        assert (len(groups), padded(lengths, groups)) == best, (lengths, budget, groups)
    # greedy: [9, 5, 5] and [1] (28 padded tokens); the fewest: [9] and [5, 5, 1] (24)
    assert group_by_tokens([9, 5, 5, 1], 27) == [[0], [1, 2, 3]]


def draw(ds, dp_sizes, budget, start=0):
    """Steps over the dp sizes (new loaders each step, as after a reconfiguration): the global
    sample indices read, and the token rows read (real tokens only)."""
    consumed, indices, rows = start, [], []
    for dp in dp_sizes:
        for r in range(dp):
            loader = TokenBudgetLoader(ds, budget, r, dp, consumed_samples=consumed, seed=5)
            step = loader.next_step(GLOBAL_BATCH)
            assert loader.consumed_samples == consumed + GLOBAL_BATCH
            assert all(b["tokens"].numel() <= budget for b in step.batches)
            assert step.tokens == sum(ds.sample_length(loader.order(g)) for g in step.samples)
            indices += list(step.samples)
            for b in step.batches:
                for row, mask in zip(b["tokens"], b["loss_mask"]):
                    assert mask.tolist() == sorted(mask.tolist(), reverse=True)  # pad at end
                    rows.append(tuple(row[mask > 0].tolist()))
        consumed += GLOBAL_BATCH
    return indices, rows


def test_an_epoch_reads_every_document_once_across_dp_changes_and_a_resume(corpus):
    docs, ds = corpus
    indices, rows = draw(ds, [2, 4], budget=SEQ)
    resumed, more = draw(ds, [1, 2, 4], budget=48, start=2 * GLOBAL_BATCH)  # a resume
    assert indices + resumed == list(range(len(ds)))  # 5 steps: one epoch, each index once
    cut = [tuple(d[: min(len(d), SEQ + 1) - 1].tolist()) for d in docs if len(d) >= 2]
    assert sorted(rows + more) == sorted(cut)  # every document once, cut at --seq-length


def test_a_resume_continues_with_the_next_unseen_sample(corpus):
    _, ds = corpus
    first = TokenBudgetLoader(ds, 32, 1, 2, seed=5)
    assert list(first.next_step(GLOBAL_BATCH).samples) == [4, 5, 6, 7]
    again = TokenBudgetLoader(ds, 32, 1, 2, consumed_samples=first.consumed_samples, seed=5)
    step = again.next_step(GLOBAL_BATCH)
    assert list(step.samples) == list(step_share(8, 1, 2, 8)) == [12, 13, 14, 15]
    same = first.next_step(GLOBAL_BATCH)  # the uninterrupted loader reads the same batches
    assert all((a["tokens"] == b["tokens"]).all() for a, b in zip(step.batches, same.batches))
