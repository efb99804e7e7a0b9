"""Pipeline schedules equal the single-process model: losses and every gradient (gloo, CPU).

Each spawned world runs several layouts in turn (groups rebuilt per layout, over a prefix of
the processes). Per layout, every rank runs its schedule on its micro batches, does the
reductions `finalize_model_grads` would (sequence-parallel grads over tp, tied embedding over
the embedding group, mean over dp), assembles its gradients to global shape over tp and
compares them with the single-process model's on all micro batches of all dp ranks. It also
checks the bytes sent with and without scatter/gather, the live activations the schedule
measured, the `no_sync` calls, and the forward-only losses.

Without processes, every schedule's communication is simulated for many (pp, vpp, micro batch)
counts; with 4 GPUs, a bf16 / nccl run of a few SGD steps is compared with one GPU.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from pipeline_helpers import (
    SEED,
    assert_rel,
    finalize_grads,
    global_grads,
    loss_fn,
    make_cfg,
    micro_batches,
    reference,
    reference_step,
    rel_error,
    simulate,
)

from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout, LayoutError
from megadyn.core.pipeline import (
    P2PCommunicator,
    PipelineConfig,
    ScheduleStats,
    forward_backward,
    forward_backward_1f1b,
    forward_backward_interleaved,
    forward_backward_no_pipelining,
    get_schedule,
)
from megadyn.core.pipeline.steps import backward_through
from megadyn.models import GPTModel, build_gpt_chunks, init_chunk
from megadyn.testing import spawn


class Case(NamedTuple):
    variant: str
    tp: int
    pp: int
    dp: int
    vpp: int
    m: int  # micro batches per step
    sp: bool = False
    bytes_check: bool = False  # rerun without scatter/gather and compare bytes sent


def expected_peak(case: Case, pp_rank: int) -> int:
    """Micro batches whose activations 1F1B (pp - i) / interleaved 1F1B hold at most."""
    if case.pp == 1:
        return 1
    if case.vpp == 1:
        return min(case.pp - pp_rank, case.m)
    total = case.m * case.vpp
    if case.m == case.pp:
        return total
    return min(total, 2 * (case.pp - pp_rank - 1) + (case.vpp - 1) * case.pp + 1)


def run_schedule(case, chunks, groups, cfg, scatter_gather=True, forward_only=False):
    for p in (p for c in chunks for p in c.parameters()):
        p.grad = None
    stats, entered = ScheduleStats(), [0]

    @contextmanager
    def no_sync():
        entered[0] += 1
        yield

    losses = forward_backward(
        chunks,
        groups,
        iter(micro_batches(groups.dp_rank, case.m)),
        case.m,
        config=PipelineConfig(cfg.hidden_size, scatter_gather_tensors_in_pipeline=scatter_gather),
        loss_fn=loss_fn,
        forward_only=forward_only,
        no_sync=no_sync,
        stats=stats,
    )
    return losses, stats, entered[0]


def check_grads(chunks, groups, cfg, ref_grads, what: str) -> None:
    """Reduce as `finalize_model_grads` would, then compare every weight on every rank."""
    finalize_grads(chunks, groups, cfg)
    grads = global_grads(chunks, groups, cfg)
    for name, grad in grads.items():
        assert_rel(grad, ref_grads[name], f"{what} {name}")
    held = [None] * (groups.tp_size * groups.pp_size)
    dist.all_gather_object(held, sorted(grads), group=groups.mp_group)
    assert set().union(*held) == set(ref_grads), f"{what}: some weights are on no rank"


def check_case(case: Case) -> None:
    layout = Layout(case.tp, case.pp, case.dp, case.vpp, case.sp)
    groups = ParallelGroups.build(layout, range(layout.world_size))
    if not groups.is_member:
        return groups.destroy()
    cfg = make_cfg(case.variant, 4 if case.pp * case.vpp <= 4 else 8)
    what = str(case)
    ref_losses, ref_grads = reference(cfg, case.m, case.dp)
    chunks = build_gpt_chunks(cfg, groups, seed=SEED)
    losses, stats, entered = run_schedule(case, chunks, groups, cfg)
    check_grads(chunks, groups, cfg, ref_grads, what)

    expected_losses = ref_losses[groups.dp_rank] if groups.is_last_stage else []
    assert len(losses) == len(expected_losses), what
    for loss, ref in zip(losses, expected_losses):
        assert_rel(loss, ref, f"{what} loss")
    assert entered == case.vpp * (case.m - 1), f"{what}: no_sync entered {entered} times"
    assert stats.peak_live_microbatches == expected_peak(case, groups.pp_rank), (
        f"{what} pp rank {groups.pp_rank}: {stats.peak_live_microbatches} micro batches alive"
    )
    assert (stats.bytes_sent > 0) == (case.pp > 1), what

    eval_losses, eval_stats, _ = run_schedule(case, chunks, groups, cfg, forward_only=True)
    assert eval_stats.peak_live_microbatches == 0, what
    for loss, ref in zip(eval_losses, expected_losses, strict=True):
        assert_rel(loss, ref, f"{what} forward-only loss")

    if case.bytes_check:  # same step without scatter/gather: same gradients, t times the bytes
        _, plain, _ = run_schedule(case, chunks, groups, cfg, scatter_gather=False)
        check_grads(chunks, groups, cfg, ref_grads, f"{what} without scatter/gather")
        ratio = 1 if case.sp else case.tp  # sequence-parallel tensors are already 1/tp
        assert stats.bytes_sent * ratio == plain.bytes_sent, (what, stats, plain)
    groups.destroy()


def check_p2p(world: int) -> None:
    """Scatter/gather over tp: received activations are whole leaves that take a gradient;
    sent ones are deallocated and still back-propagate; each rank sends 1/tp of the bytes."""
    groups = ParallelGroups.build(Layout(tp=2, pp=2, dp=world // 4), range(world))
    shape = (4, 2, 8)  # [s, b, h]
    full = torch.arange(64.0).view(shape) + 100 * groups.dp_rank
    comm = P2PCommunicator(groups, PipelineConfig(hidden_size=8), shape)
    if groups.is_first_stage:
        scale = torch.ones((), requires_grad=True)
        y = full * scale  # an activation with a graph
        grad_y = comm.send_forward_recv_backward(y)
        assert y.numel() == 1, "a sent activation is deallocated"
        torch.testing.assert_close(grad_y, 3 * full)
        backward_through(y, grad_y)
        torch.testing.assert_close(scale.grad, (3 * full * full).sum())
    else:
        x = comm.recv_forward()
        assert x.is_leaf and x.requires_grad and torch.equal(x, full)
        (1.5 * x * x).sum().backward()
        comm.send_backward(x.grad)
    assert comm.pending == 0 and comm.bytes_sent == 64 * 4 // 2
    groups.destroy()


def check_refusals(world: int) -> None:
    """Micro batch counts the interleaved schedule cannot run are refused before any draw."""
    groups = ParallelGroups.build(Layout(pp=2, dp=world // 2, vpp=2), range(world))
    cfg = make_cfg("gpt2", 4)
    chunks = build_gpt_chunks(cfg, groups, seed=SEED)
    drawn = []

    def batches():
        for batch in micro_batches(0, 3):
            drawn.append(batch)
            yield batch

    config = PipelineConfig(cfg.hidden_size)
    with pytest.raises(LayoutError) as refused:
        forward_backward(chunks, groups, batches(), 3, config=config, loss_fn=loss_fn)
    for flag in ("--global-batch-size", "--micro-batch-size", "--pipeline-model-parallel-size"):
        assert flag in str(refused.value)
    assert not drawn
    with pytest.raises(LayoutError, match="virtual stages"):
        forward_backward(chunks[:1], groups, batches(), 4, config=config, loss_fn=loss_fn)
    groups.destroy()


PP2_CASES = [
    Case("gpt2", tp=2, pp=2, dp=2, vpp=1, m=4, bytes_check=True),
    Case("llama", tp=2, pp=2, dp=2, vpp=2, m=4, sp=True, bytes_check=True),
    Case("gpt2", tp=1, pp=2, dp=2, vpp=2, m=2),  # m == pp: all forwards first
    Case("llama", tp=1, pp=2, dp=1, vpp=1, m=1),  # fewer micro batches than stages
    Case("gpt2", tp=2, pp=1, dp=2, vpp=1, m=3),  # no pipelining
]
PP4_CASES = [
    Case("llama", tp=2, pp=4, dp=1, vpp=1, m=8, bytes_check=True),
    Case("gpt2", tp=1, pp=4, dp=2, vpp=2, m=8),
    Case("gpt2", tp=2, pp=4, dp=1, vpp=2, m=4, sp=True),
    Case("llama", tp=1, pp=4, dp=2, vpp=1, m=3),
]


def parity_body(rank, world, cases, refusals):
    for case in cases:
        check_case(case)
    if refusals:
        check_p2p(world)
        check_refusals(world)


@pytest.mark.parametrize(
    "cases,refusals", [(PP2_CASES, True), (PP4_CASES, False)], ids=["pp2", "pp4"]
)
def test_pipeline_matches_single_process(cases, refusals):
    spawn(parity_body, world=8, args=(cases, refusals), timeout_s=240)


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("vpp", [1, 2, 3])
@pytest.mark.parametrize("forward_only", [False, True])
def test_schedules_communicate_consistently(pp, vpp, forward_only):
    """Without processes: every rank receives what its neighbour sends, in order, for the
    right virtual stage and micro batch, and no batched exchange waits forever."""
    schedule = forward_backward_1f1b if vpp == 1 else forward_backward_interleaved
    counts = range(1, 3 * pp + 2) if vpp == 1 else range(pp, 4 * pp + 1, pp)
    for m in counts:
        simulate(schedule, pp, vpp, m, forward_only)


def test_get_schedule():
    assert get_schedule(Layout()) is forward_backward_no_pipelining
    assert get_schedule(Layout(tp=2, pp=2)) is forward_backward_1f1b
    assert get_schedule(Layout(pp=4, vpp=2)) is forward_backward_interleaved


def test_layers_not_divisible_by_virtual_stages_are_refused():
    groups = SimpleNamespace(layout=Layout(pp=2, vpp=2))
    with pytest.raises(LayoutError, match="--num-layers-per-virtual-pipeline-stage"):
        build_gpt_chunks(make_cfg("gpt2", 6), groups)


GPU_LAYOUTS = [
    Layout(tp=2, pp=2),
    Layout(pp=2, dp=2, vpp=2),
    Layout(tp=2, pp=2, sequence_parallel=True),
    Layout(pp=4, vpp=2),
]


def gpu_body(rank, world, steps, lr, device="cuda", backend="nccl"):
    """bf16 on 4 GPUs over nccl: a few SGD steps match the single-GPU model (pp 1)."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    seq, m, dtype = 32, 4, torch.bfloat16
    cfg = make_cfg("gpt2", 8, seq, hidden_size=64, num_attention_heads=8, params_dtype=dtype)
    errors = {}
    for layout in GPU_LAYOUTS:
        groups = ParallelGroups.build(layout, range(world), backend=backend)
        chunks = build_gpt_chunks(cfg, groups, seed=SEED, device=device)
        ref = GPTModel(cfg, device=device)
        init_chunk(ref, SEED)
        params = [p for c in [ref, *chunks] for p in c.parameters()]
        worst = {"loss": 0.0, "grad": 0.0}
        for step in range(steps):
            for p in params:
                p.grad = None
            ref_losses = reference_step(ref, m, layout.dp, seq, step)
            losses = forward_backward(
                chunks,
                groups,
                iter(micro_batches(groups.dp_rank, m, seq, step)),
                m,
                config=PipelineConfig(cfg.hidden_size, dtype=dtype),
                loss_fn=loss_fn,
            )
            finalize_grads(chunks, groups, cfg)
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}
            for name, grad in global_grads(chunks, groups, cfg).items():
                worst["grad"] = max(worst["grad"], rel_error(grad, ref_grads[name]))
            for loss, ref_loss in zip(losses, ref_losses[groups.dp_rank]):
                worst["loss"] = max(worst["loss"], rel_error(loss, ref_loss))
            with torch.no_grad():
                for p in params:
                    p -= lr * p.grad
        assert worst["loss"] <= 2e-2 and worst["grad"] <= 1e-1, (layout, worst)
        errors[str(layout)] = worst
        groups.destroy()
    return errors


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_pipeline_bf16_on_gpus_matches_pp1():
    results = spawn(gpu_body, world=4, args=(3, 1.0), timeout_s=300)
    for layout, worst in results[-1].items():
        print(f"{layout}: worst relative error loss {worst['loss']:.1e}, grad {worst['grad']:.1e}")
