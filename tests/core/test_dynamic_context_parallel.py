"""Dynamic context parallelism (--cp-placement dynamic) equals static cp and the single-process
model: logits, loss and every gradient, on document-masked packed samples (and causal ones),
at cp 2 and cp 4, with tp 2 and sequence parallelism, and with pp 2; and so does the static
split computed blockwise (--cp-placement static_blocks). One spawned job of 4
processes runs every case, through the training path (the pipeline's micro-batch steps, which
place each micro batch's blocks, DDP over dp x cp, finalize_model_grads).

The same job checks the block attention alone against the dense document mask, through the
math and the fused block kernels. The placement itself is a pure function, tested without processes: on a document-masked
sample where the static split is imbalanced, every rank's attention work is within 10% of
the mean.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megadyn.core.context_parallel import dynamic_attention, split_batch_dynamic
from megadyn.core.context_parallel.flex import flex, flex_placement_attention, tile_mask
from megadyn.core.context_parallel.placement import imbalance, place_blocks, static_work
from megadyn.core.distributed import DistributedDataParallel, finalize_model_grads
from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.core.pipeline import PipelineConfig, forward_backward
from megadyn.models import GPTModel, build_gpt_chunks, init_chunk, lm_loss_for
from megadyn.models.document_attention import dense_document_mask
from megadyn.testing import spawn
from tests.core.pipeline_helpers import (
    SEED,
    assert_rel,
    global_grads,
    make_cfg,
    micro_batches,
    reference_step,
)
from tests.core.test_context_parallel import gathered_logits, packed

SEQ, M, LAYERS, BLOCK = 16, 2, 2, 2
ALL = [0, 1, 2, 3]
CASES = [  # (layout, members, model variant, documents, also compared with static cp,
    # --cp-placement)
    (Layout(cp=2), [0, 1], "llama", True, True, "dynamic"),
    (Layout(cp=2), [0, 1], "llama", False, False, "dynamic"),  # RoPE at the placed positions
    (Layout(cp=4), ALL, "gpt2", True, True, "dynamic"),
    (Layout(tp=2, cp=2, sequence_parallel=True), ALL, "llama", True, False, "dynamic"),
    (Layout(cp=2, pp=2), ALL, "gpt2", True, False, "dynamic"),
    (Layout(cp=2), [0, 1], "gpt2", True, False, "static_blocks"),
]


def train_step(layout, members, variant, documents, placement: str):
    """(groups, chunks, cfg, batches, losses) of one step, gradients reduced; None off the
    layout."""
    groups = ParallelGroups.build(layout, members)
    if not groups.is_member:
        return groups.destroy()
    cfg = make_cfg(variant, LAYERS, seq=SEQ, reset_position_ids=documents)
    chunks = build_gpt_chunks(cfg, groups, seed=SEED)
    ddp = [DistributedDataParallel(chunk, groups.dp_cp_group) for chunk in chunks]
    batches = micro_batches(groups.dp_rank, M, SEQ, transform=packed if documents else None)
    config = PipelineConfig(
        hidden_size=cfg.hidden_size,
        dtype=cfg.params_dtype,
        cp_block_size=None if placement == "static" else BLOCK,
        cp_balance=placement == "dynamic",
    )
    losses = forward_backward(
        ddp, groups, iter(batches), M, config=config, loss_fn=lm_loss_for(groups.cp_group)
    )
    finalize_model_grads(ddp, groups)
    for d in ddp:
        d.remove_hooks()
    for p in (p for chunk in chunks for p in chunk.parameters()):
        p.grad = p.main_grad  # the reduced gradient, where global_grads reads it
    return groups, chunks, cfg, batches, losses


def run_case(layout, members, variant, documents, with_static, placement, references) -> None:
    run = train_step(layout, members, variant, documents, placement)
    static = train_step(layout, members, variant, documents, "static") if with_static else None
    if run is None:
        return
    groups, chunks, cfg, batches, losses = run
    what = f"{layout} {variant} {placement}" + (" documents" if documents else "")
    ref_model, ref_losses, ref_grads = references[(variant, documents)]
    grads = global_grads(chunks, groups, cfg)
    if groups.is_last_stage:
        assert_rel(torch.stack(losses), torch.stack(ref_losses[0]), f"{what} loss")
    for name, grad in grads.items():
        assert_rel(grad, ref_grads[name], f"{what} grad {name}")
    if static is not None:
        s_groups, s_chunks, _, _, s_losses = static
        assert_rel(torch.stack(losses), torch.stack(s_losses), f"{what} loss vs static")
        for name, grad in global_grads(s_chunks, s_groups, cfg).items():
            assert_rel(grads[name], grad, f"{what} grad {name} vs static")
        s_groups.destroy()
    if layout.pp == 1:
        full = batches[0]
        balance = placement == "dynamic"
        batch = split_batch_dynamic(full, groups.cp_rank, groups.cp_size, BLOCK, balance)
        with torch.no_grad():
            ref_logits = ref_model(
                full["tokens"], full["position_ids"], document_ids=full.get("document_ids")
            )
        assert_rel(gathered_logits(chunks[0], batch, groups), ref_logits, f"{what} logits")
    groups.destroy()


def check_attention_kernels(rank, world) -> None:
    """dynamic_attention alone, output and q/k/v gradients, against the dense document mask,
    through the math and the fused (CPU flash) block kernels and the flex_attention call over
    the gathered keys (flex.py), grouped queries."""
    torch.manual_seed(0)
    seq, block, b, heads, groups, d = 32, 2, 2, 4, 2, 8
    q, k, v = (
        torch.randn(b, heads, seq, d),
        torch.randn(b, groups, seq, d),
        torch.randn(b, groups, seq, d),
    )
    ids = torch.zeros(b, seq, dtype=torch.long)
    ids[0, 5:] += 1
    ids[0, 20:] += 1
    ids[1, 14:] += 1
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, attn_mask=dense_document_mask(ids), enable_gqa=True)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    placement = place_blocks(seq, block, world, ids)
    index = placement.token_index(rank)
    for kernel in ("math", "flash", "flex"):
        mine = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
        if kernel == "flex":  # the GPU's path (CUDA, 16-bit), eager here, tiles of a block
            out = flex_placement_attention(*mine, dist.group.WORLD, placement, tile=block)
        else:
            out = dynamic_attention(*mine, dist.group.WORLD, placement, kernel=kernel)
        out.backward(grad[:, :, index])
        assert_rel(out, ref[:, :, index], f"{kernel} out")
        for name, t, r in zip("qkv", mine, full):
            assert_rel(t.grad, r.grad[:, :, index], f"{kernel} d{name}")


def body(rank, world):
    check_attention_kernels(rank, world)
    references = {}
    for variant, documents in [("gpt2", True), ("llama", False), ("llama", True)]:
        model = GPTModel(make_cfg(variant, LAYERS, seq=SEQ, reset_position_ids=documents))
        init_chunk(model, SEED)
        losses = reference_step(model, M, 1, seq=SEQ, transform=packed if documents else None)
        grads = {n: p.grad for n, p in model.named_parameters()}
        references[(variant, documents)] = (model, losses, grads)
    for case in CASES:
        run_case(*case, references)


def test_dynamic_context_parallel_matches_static_and_single_process():
    spawn(body, world=4)


def skewed_documents(seq: int, lengths: list[int]) -> torch.Tensor:
    """[1, seq] document ids of documents of `lengths` (the last one runs to the end)."""
    ids, start = torch.zeros(1, seq, dtype=torch.long), 0
    for doc, length in enumerate(lengths):
        ids[0, start : start + length] = doc
        start += length
    ids[0, start:] = len(lengths)
    return ids


@pytest.mark.parametrize("cp", [2, 4])
def test_placement_balances_attention_work_where_static_does_not(cp):
    """One long document then many short ones (4096 tokens, blocks of 64): the static split's
    late chunks hold only short documents, so its ranks' work differs; the placement's
    does not, and its blocks cover the sequence once, the same count per rank; at cp 2 in
    at most two runs of consecutive blocks per rank (a window)."""
    seq, block = 4096, 64
    ids = skewed_documents(seq, [2600] + [100] * 10 + [37, 211, 64, 150])
    placement = place_blocks(seq, block, cp, ids)
    static, dynamic = imbalance(static_work(seq, cp, ids)), imbalance(list(placement.work))
    print(f"cp {cp}: attention work imbalance static {static:.1%}, dynamic {dynamic:.1%}")
    assert static > 0.3 and dynamic < 0.1
    held = sorted(b for blocks in placement.blocks for b in blocks)
    assert held == list(range(seq // block))
    assert {len(blocks) for blocks in placement.blocks} == {seq // block // cp}
    if cp == 2:  # a window: each rank holds at most two runs of consecutive blocks
        runs = [1 + sum(b - a > 1 for a, b in zip(held, held[1:])) for held in placement.blocks]
        assert max(runs) <= 2, placement.blocks
    visible = sum(len(placement.pairs(r)) for r in range(cp))
    assert visible < (seq // block) * (seq // block + 1) // 2  # pairs across documents skipped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_flex_call_over_a_placement_on_gpu():
    """flex.py's compiled call on the GPU (bf16): each rank's queries over every rank's keys in
    rank order, under the tile mask of the placement's positions, against fp32 attention
    under the dense document mask; output and gradients."""
    seq, block, heads, d = 4096, 256, 4, 64
    ids = skewed_documents(seq, [1900, 100, 700, 33, 300])
    dense = dense_document_mask(ids).cuda()  # [1, 1, S, S]
    for cp in (2, 4):
        placement = place_blocks(seq, block, cp, ids)
        keys = torch.cat([placement.token_index(r, "cuda") for r in range(cp)])
        for r in range(cp):
            rows = placement.token_index(r, "cuda")
            torch.manual_seed(r)
            q, k, v = (torch.randn(1, heads, seq, d, device="cuda") for _ in "qkv")
            grad = torch.randn(1, heads, rows.numel(), d, device="cuda")
            mine = [t.bfloat16().requires_grad_() for t in (q, k, v)]
            mask = tile_mask(ids.cuda(), rows, keys)
            out = flex(mine[0][:, :, rows], mine[1][:, :, keys], mine[2][:, :, keys], mask)
            out.backward(grad.bfloat16())
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*full, attn_mask=dense)[:, :, rows]
            ref.backward(grad)
            for name, got, want in [("out", out, ref)] + [
                (f"d{n}", t.grad, r.grad) for n, t, r in zip("qkv", mine, full)
            ]:
                err = (got.float() - want).abs().max() / want.abs().max()
                assert err < 2e-2, f"cp {cp} rank {r} {name}: {err:.4f}"
