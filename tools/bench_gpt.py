"""Benchmark megadyn's training step on the reference GPT shapes; one JSON line, as the
Megatron-Core reference script prints it (same arguments, same fields, same FLOPs formula).

    torchrun --nproc-per-node 2 tools/bench_gpt.py --tp 2 --pp 1           # like mcore_gpt_bench.py
    torchrun --nproc-per-node 2 tools/bench_gpt.py --tp 2 --sp             # megadyn-only: sequence parallel

Random tokens, bf16 weights with fp32 main weights, the distributed optimizer, untied
embeddings, no dropout: the configuration of the reference script. Timing is the median
iteration after warm-up; peak memory is the maximum over ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
import torch.distributed as dist

from megadyn.core.distributed import DistributedDataParallel, finalize_model_grads
from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.core.optimizer import OptimizerConfig, build_optimizer
from megadyn.core.pipeline import (
    MicroBatchGraph,
    PipelineConfig,
    check_cuda_graph,
    forward_backward,
)
from megadyn.core.recompute import RecomputeConfig
from megadyn.core.tensor_parallel import RNGTracker, seed_default_generator
from megadyn.launch.distributed_init import init_distributed
from megadyn.models import GPTConfig, build_gpt_chunks


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--gbs", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--sp", action="store_true", help="sequence parallel")
    p.add_argument(
        "--attn", choices=["sdpa", "local"], default="sdpa", help="megadyn always uses sdpa"
    )
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU")
    # megadyn-only switches
    p.add_argument("--no-overlap-grad-reduce", action="store_true")
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument(
        "--no-overlap-param-gather",
        action="store_true",
        help="gather updated params right after the step instead of during the next forward",
    )
    p.add_argument(
        "--no-grad-accumulation-fusion",
        action="store_true",
        help="weight gradients through param.grad and the DDP hook's add",
    )
    p.add_argument(
        "--fused-loss",
        choices=["auto", "on", "off"],
        default="auto",
        help="the cross entropy through its Triton kernels (auto: on a GPU)",
    )
    p.add_argument(
        "--attention-backend",
        choices=["auto", "flash", "fused", "unfused", "local"],
        default="auto",
        help="attention kernel (fused = cuDNN; auto = cuDNN first on Hopper)",
    )
    p.add_argument(
        "--cuda-graph",
        "--enable-cuda-graph",
        dest="cuda_graph",
        action="store_true",
        help="replay each micro batch's forward and backward from a CUDA graph (pp 1)",
    )
    p.add_argument("--cuda-graph-warmup-steps", type=int, default=2)
    p.add_argument(
        "--gemm-sm-carveout",
        type=int,
        default=None,
        help="SMs cuBLAS leaves free for the collectives beside its GEMMs (torch's experimental knob)",
    )
    p.add_argument(
        "--tp-comm-overlap",
        action="store_true",
        help="under --sp: GEMMs split by sequence chunk beside the all-gathers / reduce-scatter",
    )
    p.add_argument("--tp-comm-overlap-transport", choices=["nccl", "copy-engine"], default="nccl")
    p.add_argument(
        "--profile", default=None, help="directory: torch.profiler summary of 2 iterations"
    )
    return p.parse_args()


def profile(a, step, sync) -> None:
    """Two profiled iterations; rank 0 writes a kernel summary, its trace and how much of the
    communication ran beside compute (tools/trace_overlap.py) under `a.profile`."""
    import os

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from trace_overlap import summarize, write_kernels_csv  # beside this script

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with torch_profile(activities=acts) as prof:
        for _ in range(2):
            step()
        sync()
    if dist.get_rank() == 0:
        os.makedirs(a.profile, exist_ok=True)
        name = f"tp{a.tp}_pp{a.pp}{'_sp' if a.sp else ''}"
        if a.tp_comm_overlap:
            name += "_overlap" + ("_ce" if a.tp_comm_overlap_transport == "copy-engine" else "")
        name += "_graph" if a.cuda_graph else ""
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
        with open(os.path.join(a.profile, f"{name}.txt"), "w") as f:
            f.write(table)
        print(table[:6000], flush=True)
        trace_path = os.path.join(a.profile, f"{name}.json")
        prof.export_chrome_trace(trace_path)
        if not torch.cuda.is_available():
            return
        with open(trace_path) as f:
            trace = json.load(f)
        overlap = summarize(trace, steps=2)
        write_kernels_csv(trace, os.path.join(a.profile, f"{name}_kernels.csv.gz"))
        print("overlap per step (ms):", json.dumps(dict(run=name, **overlap)), flush=True)


def main() -> None:
    a = parse()
    device = init_distributed()
    if a.gemm_sm_carveout is not None:
        torch._C._set_sm_carveout_experimental(a.gemm_sm_carveout)
    world = dist.get_world_size()
    layout = Layout.from_world(world, a.tp, a.pp, a.vpp or 1, a.sp)
    groups = ParallelGroups.build(layout, range(world))
    cfg = GPTConfig.gpt2(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        ffn_hidden_size=4 * a.hidden,
        vocab_size=a.vocab,
        max_position_embeddings=a.seq,
        untie_embeddings_and_output_weights=True,
        params_dtype=torch.bfloat16,
        gradient_accumulation_fusion=not a.no_grad_accumulation_fusion,
        fused_loss=dict(auto=None, on=True, off=False)[a.fused_loss],
        attention_backend=a.attention_backend,
        tp_comm_overlap=a.tp_comm_overlap,
        tp_comm_overlap_transport=a.tp_comm_overlap_transport,
    )
    recompute = dict(
        none=RecomputeConfig(),
        selective=RecomputeConfig("selective"),
        full=RecomputeConfig("full", "uniform", 1),
    )[a.recompute]
    seed_default_generator(1234, groups.pp_rank, device)
    tracker = RNGTracker.create(1234, groups.tp_rank, groups.pp_rank, device)
    chunks = build_gpt_chunks(
        cfg, groups, recompute_cfg=recompute, tracker=tracker, seed=1234, device=device
    )
    distopt = not a.no_distributed_optimizer
    ddp = [
        DistributedDataParallel(
            c,
            groups.dp_group,
            overlap_grad_reduce=not a.no_overlap_grad_reduce,
            use_distributed_optimizer=distopt,
            overlap_param_gather=not a.no_overlap_param_gather,
        )
        for c in chunks
    ]
    opt = build_optimizer(
        chunks, ddp, groups, OptimizerConfig(lr=1e-4, bf16=True, use_distributed_optimizer=distopt)
    )
    pipe = PipelineConfig(hidden_size=cfg.hidden_size, dtype=cfg.params_dtype)
    num_micro = a.gbs // (a.mbs * layout.dp)
    gen = torch.Generator(device=device).manual_seed(groups.dp_rank + 7)
    pos = torch.arange(a.seq, device=device).unsqueeze(0).expand(a.mbs, -1)
    ones = torch.ones(a.mbs, a.seq, device=device)

    def batches():
        while True:
            tok = torch.randint(0, a.vocab, (a.mbs, a.seq + 1), device=device, generator=gen)
            yield dict(tokens=tok[:, :-1], labels=tok[:, 1:], loss_mask=ones, position_ids=pos)

    def no_sync():
        stack = contextlib.ExitStack()
        for d in ddp:
            stack.enter_context(d.no_sync())
        return stack

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    data = batches()
    graph = None
    if a.cuda_graph:
        recompute_kind = None if a.recompute == "none" else a.recompute
        check_cuda_graph(
            pp=a.pp, vpp=a.vpp or 1, dropout=0.0, recompute=recompute_kind, device=device
        )
        graph = MicroBatchGraph(a.cuda_graph_warmup_steps)

    def loss_fn(loss, batch):
        return loss.float().mean()

    def step():
        opt.zero_grad()
        forward_backward(
            ddp,
            groups,
            data,
            num_micro,
            config=pipe,
            loss_fn=loss_fn,
            no_sync=no_sync,
            cuda_graph=graph,
        )
        finalize_model_grads(ddp, groups)
        opt.step()

    times, warmup_times = [], []
    for i in range(a.warmup + a.iters):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        (times if i >= a.warmup else warmup_times).append(time.perf_counter() - t0)
    if a.profile:
        profile(a, step, sync)
    ordered = sorted(times)
    med = ordered[len(ordered) // 2]
    s, n_layers, h, V, B = a.seq, a.layers, a.hidden, a.vocab, a.gbs
    flops = 72 * B * s * n_layers * h * h * (1 + s / (6 * h) + V / (12 * n_layers * h))
    tflops = flops / med / world / 1e12
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    mem = torch.tensor([peak], device=device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    res = dict(
        framework="megadyn",
        tp=a.tp,
        pp=a.pp,
        vpp=a.vpp,
        dp=layout.dp,
        sp=a.sp,
        cuda_graph=a.cuda_graph,
        tp_comm_overlap=a.tp_comm_overlap,
        tp_comm_overlap_transport=a.tp_comm_overlap_transport if a.tp_comm_overlap else None,
        gemm_sm_carveout=a.gemm_sm_carveout,
        attn="sdpa",
        attention_backend=a.attention_backend,
        recompute=a.recompute,
        layers=n_layers,
        hidden=h,
        seq=s,
        mbs=a.mbs,
        gbs=B,
        iter_s=round(med, 4),
        iters_s=[round(t, 3) for t in times],
        warmup_iter_s=[round(t, 3) for t in warmup_times],  # the first includes one-time costs
        tokens_per_s_per_gpu=round(B * s / med / world, 1),
        tflops_per_gpu=round(tflops, 1),
        mfu=round(tflops / a.peak_tflops, 4),
        peak_mem_gib=round(mem.item(), 2),
    )
    if dist.get_rank() == 0:
        print(json.dumps(res), flush=True)
    if graph is not None:
        graph.reset()  # before its communicators go (NCCL waits for graphs that use them)
    groups.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
