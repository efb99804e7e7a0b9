"""Document masking of packed samples (--reset-position-ids, --reset-attention-mask,
--eod-mask-loss) in one process: the data transform, the masks against a dense mask built here
from the tokens by a loop, the flex_attention block mask, and the model, whose logits on a
packed sample equal those of each document run alone. The parallel layouts (cp, tp, pp) are
checked against this single-process model in tests/core/test_context_parallel.py."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from megadyn.core.context_parallel.flex import emulated_mask
from megadyn.data import MicroBatchLoader, MockGPTDataset
from megadyn.data.documents import DocumentMasking
from megadyn.models import GPTConfig, GPTModel, init_chunk, lm_loss
from megadyn.models.document_attention import (
    DocumentMask,
    dense_document_mask,
    document_attention,
    document_block_mask,
)

EOD = 5


def loop_mask(tokens: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s]: query i sees key j <= i when no EOD lies in tokens[j:i] (an EOD ends its
    own document), written as plainly as possible."""
    b, s = tokens.shape
    mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
    for n in range(b):
        for i in range(s):
            for j in range(i + 1):
                mask[n, 0, i, j] = not (tokens[n, j:i] == EOD).any()
    return mask


def packed_tokens(b: int, s: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(EOD + 1, 50, (b, s), generator=g)
    tokens[torch.rand(b, s, generator=g) < 0.08] = EOD
    tokens[0, [0, 1, s - 1]] = EOD  # empty documents, an EOD at each end
    return tokens


def test_the_flags_reset_positions_documents_and_loss_at_each_eod():
    tokens = torch.tensor([[11, 12, EOD, 13, 14, EOD, 15], [EOD, EOD, 16, 17, 18, 19, EOD]])
    batch = {"tokens": tokens, "loss_mask": torch.ones(2, 7)}
    out = DocumentMasking(EOD, True, True, True)(batch)
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3, 4]]
    assert out["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2, 2]]
    assert out["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 0, 1], [0, 0, 1, 1, 1, 1, 0]]
    assert torch.equal(dense_document_mask(out["document_ids"]), loop_mask(tokens))
    assert DocumentMasking(EOD, reset_position_ids=True)(batch).keys() == {
        "tokens",
        "loss_mask",
        "position_ids",
    }
    # the loader applies it to each micro batch, reading the same samples as without it
    data = MockGPTDataset(vocab_size=40, seq_length=32, seed=3, num_samples=16, eod=EOD)
    plain = MicroBatchLoader(data, 2, dp_rank=1, dp_size=2, consumed_samples=4)
    masked = MicroBatchLoader(data, 2, 1, 2, consumed_samples=4, transform=DocumentMasking(EOD))
    a, b = next(plain), next(masked)
    assert torch.equal(a["tokens"], b["tokens"]) and masked.consumed_samples == 8


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_document_attention_matches_a_dense_mask_and_differs_from_causal():
    b, s = 2, 70
    tokens = packed_tokens(b, s)
    ids = DocumentMasking(EOD, reset_attention_mask=True)({"tokens": tokens})["document_ids"]
    reference_mask = loop_mask(tokens)
    q = torch.randn(b, 4, s, 8, dtype=torch.float64)
    k, v = torch.randn(2, b, 2, s, 8, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=reference_mask, enable_gqa=True)
    out = document_attention(q, k, v, DocumentMask.build(ids))
    torch.testing.assert_close(out, ref)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (causal - ref).abs().max() > 0.1  # the documents change the result
    # flex_attention's block mask (the GPU path; eager here): skipped tiles, unmasked full
    # tiles and masked partial ones must all be right, with s not a multiple of the tile
    block = document_block_mask(ids, block=16)
    tiles = F.pad(reference_mask[:, 0], (0, 10, 0, 10)).view(b, 5, 16, 5, 16)
    assert torch.equal(block.to_dense()[:, 0].bool(), tiles.any(-1).any(-2))
    # what flex_attention computes: full tiles whole, partial ones through the mask_mod
    assert torch.equal(emulated_mask(block, s, s), reference_mask)
    flex = flex_attention(q, k, v, block_mask=block, enable_gqa=True)
    torch.testing.assert_close(flex, ref)


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_a_packed_sample_is_each_document_alone(variant):
    """With positions reset and attention kept within documents, the logits of a packed
    sample are those of its documents run one by one; --eod-mask-loss gives the masked mean."""
    common = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50)
    common.update(max_position_embeddings=32, make_vocab_size_divisible_by=8)
    common.update(reset_position_ids=True)
    cfg = (
        GPTConfig.gpt2(**common)
        if variant == "gpt2"
        else GPTConfig.llama(num_query_groups=2, **common)
    )
    model = GPTModel(cfg)
    init_chunk(model, 1234)
    tokens = torch.tensor([[11, 12, 13, EOD, 14, 15, EOD, 16, 17, 18, 19, 20]])
    batch = {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, 1),
        "loss_mask": torch.ones(1, 12),
    }
    batch = DocumentMasking(EOD, True, True, True)(batch)
    with torch.no_grad():
        logits = model(tokens, batch["position_ids"], document_ids=batch["document_ids"])
        alone = torch.cat([model(doc) for doc in tokens.split([4, 3, 5], dim=1)])
        unmasked = model(tokens)
    torch.testing.assert_close(logits, alone)
    assert (unmasked - logits).abs().max() > 1e-3  # the masks change the model's output
    per_token = model(
        tokens, batch["position_ids"], labels=batch["labels"], document_ids=batch["document_ids"]
    )
    kept = tokens[0] != EOD
    torch.testing.assert_close(lm_loss(per_token, batch), per_token[0, kept].mean())


def test_rotary_tables_follow_reset_positions():
    cfg = GPTConfig.llama(
        num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=50, reset_position_ids=True
    )
    model = GPTModel(cfg)
    init_chunk(model, 1234)
    tokens = torch.tensor([[11, 12, 13, EOD, 14, 15, 16, 17], [18, 19, 20, 21, EOD, 22, 23, 24]])
    reset = DocumentMasking(EOD, reset_position_ids=True)({"tokens": tokens})["position_ids"]
    with torch.no_grad():
        plain = model(tokens)
        counted = model(tokens, torch.arange(8).expand(2, 8))
        restarted = model(tokens, reset)
    torch.testing.assert_close(counted, plain)
    torch.testing.assert_close(restarted[:4], plain[:4])  # the first document: same positions
    assert (restarted[5:] - plain[5:]).abs().max() > 1e-5  # later ones: restarted positions
