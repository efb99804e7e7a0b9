"""The micro-batch CUDA graph (megadyn/core/pipeline/cuda_graph.py).

On CPU a recording stand-in for the graph proves the plumbing: capture runs nothing, every
replay reads the micro batch copied into the graph's inputs, losses are copied out, gradients
accumulate into `main_grad` exactly as the eager schedule's, and a replaced parameter makes the
graph capture again. On 2 GPUs (nccl, bf16) the real CUDA graph of a tp2 and a tp2 + sequence
parallel step gives the eager step's losses and gradients.
"""

from __future__ import annotations

import pytest
import torch

from megadyn.core.distributed import DistributedDataParallel
from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.core.pipeline import (
    MicroBatchGraph,
    PipelineConfig,
    check_cuda_graph,
    forward_backward,
)
from megadyn.models import build_gpt_chunks
from megadyn.testing.spawn import spawn
from tests.core.pipeline_helpers import SEED, loss_fn, make_cfg, micro_batches, rel_error


class RecordOnly:
    """Stands in for torch.cuda.CUDAGraph: capturing records the function without running it,
    a replay runs it again on whatever the graph's input tensors hold then."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self) -> None:
        self.fn()

    def reset(self) -> None:
        self.fn = None


def train(layout, world, steps, m, graph, device, dtype, backend=None, overlap=None):
    """`steps` steps of `m` micro batches (SGD on main_grad); per-step losses and the final
    main_grads, with or without `graph` (and --tp-comm-overlap's split GEMMs)."""
    seq = 16
    cfg = make_cfg(
        "gpt2",
        2,
        seq,
        params_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tp_comm_overlap=bool(overlap),
        tp_comm_overlap_transport=overlap or "nccl",
    )
    groups = ParallelGroups.build(layout, range(world), backend=backend)
    chunks = build_gpt_chunks(cfg, groups, seed=SEED, device=device)
    ddp = [DistributedDataParallel(c, groups.dp_group, overlap_grad_reduce=True) for c in chunks]
    losses = []
    for step in range(steps):
        ddp[0].zero_grad_buffer()
        out = forward_backward(
            ddp,
            groups,
            iter(micro_batches(groups.dp_rank, m, seq, step)),
            m,
            config=PipelineConfig(cfg.hidden_size, dtype=dtype),
            loss_fn=loss_fn,
            no_sync=ddp[0].no_sync,
            cuda_graph=graph,
        )
        ddp[0].finish_grad_sync()
        losses.append(torch.stack(out).float().cpu())
        with torch.no_grad():
            for p in ddp[0].module.parameters():
                p -= 0.1 * p.main_grad.to(p.dtype)
    grads = {n: p.main_grad.float().cpu() for n, p in ddp[0].module.named_parameters()}
    if graph is not None:
        graph.reset()  # before the communicators it captured are destroyed
    groups.destroy()
    return losses, grads


def cpu_body(rank, world):
    layout = Layout(tp=2)
    args = (layout, world, 4, 3)
    eager = train(*args, None, "cpu", torch.float32)
    graph = MicroBatchGraph(warmup_steps=1, capture=RecordOnly)
    graphed = train(*args, graph, "cpu", torch.float32)
    assert graph.calls == 4 and graph.captures == 1, (graph.calls, graph.captures)
    assert graph._graph is None  # reset: nothing left to replay
    for step, (a, b) in enumerate(zip(eager[0], graphed[0])):
        assert torch.equal(a, b), f"step {step} losses {a} != {b}"
    for name, grad in eager[1].items():
        assert torch.equal(grad, graphed[1][name]), name
    # --tp-comm-overlap (GEMMs split by sequence chunk beside the collectives) under a graph
    sp = (Layout(tp=2, sequence_parallel=True), world, 3, 2)
    plain = train(*sp, None, "cpu", torch.float32)
    graph = MicroBatchGraph(warmup_steps=1, capture=RecordOnly)
    overlapped = train(*sp, graph, "cpu", torch.float32, overlap="nccl")
    for a, b in zip(overlapped[0], plain[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name, grad in plain[1].items():
        torch.testing.assert_close(overlapped[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    return True


def test_graph_plumbing_matches_the_eager_schedule_on_cpu():
    assert all(spawn(cpu_body, world=2))


def test_a_replaced_parameter_captures_again():
    chunk = torch.nn.Linear(4, 1)
    batch = dict(tokens=torch.zeros(2, 4), labels=torch.zeros(2, 4))

    def run(**kw):
        return chunk.weight.sum() + kw["tokens"].sum()

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = chunk

        def forward(self, **kw):
            return run(**kw)

    def loss_of(out, batch):
        return out

    def replay(batch):  # one step of one micro batch
        graph.prepare(model, batch, loss_of, None)
        return graph.replay(batch, 1.0)

    model = Chunk()
    graph = MicroBatchGraph(warmup_steps=1, capture=RecordOnly)
    first = replay(batch)
    ones = dict(tokens=torch.ones(2, 4), labels=batch["labels"])
    assert replay(ones).item() == pytest.approx(first.item() + 8)
    assert graph.captures == 1
    chunk.weight = torch.nn.Parameter(torch.ones(1, 4))  # a rebuilt model: new storage
    assert replay(batch).item() == 4.0
    assert graph.captures == 2
    replay(dict(tokens=torch.ones(3, 4), labels=torch.ones(3, 4)))
    assert graph.captures == 3  # another micro batch shape


def test_what_a_graph_cannot_capture_is_refused():
    ok = dict(pp=1, vpp=1, dropout=0.0, recompute=None, device="cuda")
    check_cuda_graph(**ok)
    for change, flag in [
        (dict(device="cpu"), "CUDA"),
        (dict(pp=2), "--pipeline-model-parallel-size"),
        (dict(dropout=0.1), "--hidden-dropout"),
        (dict(recompute="full"), "--recompute-granularity"),
    ]:
        with pytest.raises(ValueError, match=flag):
            check_cuda_graph(**{**ok, **change})
    with pytest.raises(ValueError, match="--cuda-graph-warmup-steps"):
        MicroBatchGraph(warmup_steps=0)


def compare(worst, name, got, want, loss_tol, grad_tol):
    """Record and check the worst relative errors of `got`'s losses and gradients."""
    loss = max(rel_error(a, b) for a, b in zip(got[0], want[0]))
    grad = max(rel_error(got[1][n], g) for n, g in want[1].items())
    worst[name] = (loss, grad)
    assert loss <= loss_tol and grad <= grad_tol, (name, loss, grad)


def graph_vs_eager(worst, layout, world, overlap):
    """The eager run of `layout` (with --tp-comm-overlap's `overlap` transport), checked
    against the same run under a CUDA graph."""
    args = (layout, world, 5, 4)
    eager = train(*args, None, "cuda", torch.bfloat16, backend="nccl", overlap=overlap)
    graph = MicroBatchGraph(warmup_steps=2)
    graphed = train(*args, graph, "cuda", torch.bfloat16, backend="nccl", overlap=overlap)
    assert graph.captures == 1
    name = f"{layout}{f' --tp-comm-overlap ({overlap})' if overlap else ''}"
    compare(worst, f"graph vs eager, {name}", graphed, eager, 1e-3, 1e-2)
    return eager


def gpu_body(rank, world):
    torch.cuda.set_device(rank)
    worst = {}
    graph_vs_eager(worst, Layout(tp=2), world, None)
    sp = Layout(tp=2, sequence_parallel=True)
    plain = graph_vs_eager(worst, sp, world, None)
    for transport in ("nccl", "copy-engine"):
        got = graph_vs_eager(worst, sp, world, transport)
        compare(worst, f"eager --tp-comm-overlap ({transport}) vs eager SP", got, plain, 1e-2, 5e-2)
    return worst


def gpu4_body(rank, world):
    """tp 4 (the copy engines gather from three peers) and tp 2 x dp 2 (two tensor-parallel
    groups, each with its own symmetric-memory workspace)."""
    torch.cuda.set_device(rank)
    worst = {}
    for layout in (
        Layout(tp=4, sequence_parallel=True),
        Layout(tp=2, dp=2, sequence_parallel=True),
    ):
        plain = train(layout, world, 5, 4, None, "cuda", torch.bfloat16, backend="nccl")
        got = graph_vs_eager(worst, layout, world, "copy-engine")
        compare(
            worst, f"eager {layout} --tp-comm-overlap (copy-engine) vs SP", got, plain, 1e-2, 5e-2
        )
    return worst


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_graph_matches_eager_on_gpus():
    for layout, (loss, grad) in spawn(gpu_body, world=2, timeout_s=300)[0].items():
        print(f"{layout}: relative error loss {loss:.1e}, grad {grad:.1e}")


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_copy_engine_overlap_on_4_gpus():
    for layout, (loss, grad) in spawn(gpu4_body, world=4, timeout_s=300)[0].items():
        print(f"{layout}: relative error loss {loss:.1e}, grad {grad:.1e}")
