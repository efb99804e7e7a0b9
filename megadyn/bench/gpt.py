"""Time megadyn's training step on the reference GPT shapes (tools/bench_gpt.py).

    a = parse_args(description="...")         # the flags of the Megatron-Core reference script
    device = init_distributed()
    record = run_gpt_bench(a, device)         # the JSON record, the same on every rank

The flags become a job config (`job_config`) and the job is a `Trainer` built as pretrain_gpt.py
builds it (megadyn/training/trainer.py: the layout's parts, its kind of step); what is timed is
`Trainer.train_step`, the step training runs, on micro batches of random tokens
(`RandomTokens`). The record has the reference script's fields and FLOPs formula, so numbers
compare across frameworks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
import torch.distributed as dist

from megadyn.bench.documents import skewed_document_ids
from megadyn.bench.gpt_model import add_model_args, check_model_args, model_config, model_record
from megadyn.bench.trace_overlap import summarize, write_kernels_csv
from megadyn.core import c10d_compat
from megadyn.core.distributed.sharded_grads import STRATEGIES
from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.core.optimizer import OptimizerConfig
from megadyn.core.pipeline import check_cuda_graph
from megadyn.core.recompute import RecomputeConfig
from megadyn.data.sampler import DataCursor
from megadyn.training.config import (
    ConfigError,
    DataConfig,
    MegadynConfig,
    ParallelConfig,
    TrainingConfig,
)
from megadyn.training.trainer import Trainer
from megadyn.training.validation import validate_sharding_strategy

SEED = 1234


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    add_model_args(p)  # the shape and pretrain_gpt.py's architecture flags
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--gbs", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--sp", action="store_true", help="sequence parallel")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--cp-comm-type", choices=["p2p", "all_gather", "a2a"], default="p2p")
    p.add_argument(
        "--cp-placement", choices=["static", "dynamic", "static_blocks"], default="static"
    )
    p.add_argument("--cp-block-size", type=int, default=1024)
    p.add_argument(
        "--documents",
        default=None,
        metavar="MEDIAN:SIGMA",
        help="document-masked samples, document lengths log-normal (megadyn/bench/documents.py)",
    )
    p.add_argument(
        "--attn", choices=["sdpa", "local"], default="sdpa", help="megadyn always uses sdpa"
    )
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU")
    # megadyn-only switches
    p.add_argument("--no-overlap-grad-reduce", action="store_true")
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument(
        "--num-distributed-optimizer-instances",
        dest="distopt_instances",
        type=int,
        default=1,
        help="copies of the distributed optimizer's state, each sharded over dp / N ranks",
    )
    p.add_argument(
        "--data-parallel-sharding-strategy",
        choices=STRATEGIES,
        default="optim",
        help="optim_grads: gradients sharded over dp too (ZeRO-2; pp 1)",
    )
    p.add_argument(
        "--use-precision-aware-optimizer",
        action="store_true",
        help="bf16 weight + 16-bit remainder in place of each fp32 main weight (pretrain_gpt's flag)",
    )
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
        "--fp8-format",
        choices=["e4m3", "hybrid"],
        default=None,
        help="fp8 GEMMs in the transformer blocks' linear layers (hybrid: e5m2 gradients)",
    )
    p.add_argument("--fp8-recipe", choices=["tensorwise", "rowwise"], default="tensorwise")
    p.add_argument(
        "--no-fp8-weight-cache",
        action="store_true",
        help="quantize each fp8 weight at every micro batch, not once per step (less memory)",
    )
    p.add_argument(
        "--profile", default=None, help="directory: torch.profiler summary of 2 iterations"
    )
    a = p.parse_args(argv)
    check_model_args(p, a)
    return a


def job_config(a: argparse.Namespace) -> MegadynConfig:
    """The reference script's job: bf16 weights with fp32 main weights (remainders under
    --use-precision-aware-optimizer), the distributed optimizer, untied embeddings, lr 1e-4, seed 1234; iterations for every timed, warm-up and
    profiled step, no evaluation. Its data (synthetic tokens) is built but not read: the
    benchmark's steps read `RandomTokens`."""
    model = model_config(a)  # pretrain_gpt.py's model for the same flags
    recompute = dict(
        none=RecomputeConfig(),
        selective=RecomputeConfig("selective"),
        full=RecomputeConfig("full", "uniform", 1),
    )[a.recompute]
    distopt = not a.no_distributed_optimizer
    return MegadynConfig(
        model=model,
        data=DataConfig(seq_length=a.seq, vocab_size=a.vocab - 1, mock_data=True, num_workers=0),
        parallel=ParallelConfig(
            tp=a.tp,
            pp=a.pp,
            cp=a.cp,
            sequence_parallel=a.sp,
            overlap_grad_reduce=not a.no_overlap_grad_reduce,
            overlap_param_gather=not a.no_overlap_param_gather,
            num_distributed_optimizer_instances=a.distopt_instances,
            data_parallel_sharding_strategy=a.data_parallel_sharding_strategy,
        ),
        training=TrainingConfig(
            micro_batch_size=a.mbs,
            global_batch_size=a.gbs,
            train_iters=a.warmup + a.iters + 2,
            eval_iters=0,
            seed=SEED,
            recompute=recompute,
            enable_cuda_graph=a.cuda_graph,
            cuda_graph_warmup_steps=a.cuda_graph_warmup_steps,
        ),
        optimizer=OptimizerConfig(
            lr=1e-4,
            bf16=True,
            use_distributed_optimizer=distopt,
            use_precision_aware_optimizer=a.use_precision_aware_optimizer,
        ),
    )


def random_batches(a: argparse.Namespace, dp_rank: int, device):
    """Micro batches of random tokens, different on each data-parallel rank; with
    `--documents MEDIAN:SIGMA` packed documents of log-normal lengths (their `document_ids`
    made on the CPU, where the dynamic cp placement reads them)."""
    gen = torch.Generator(device=device).manual_seed(dp_rank + 7)
    docs = torch.Generator().manual_seed(dp_rank + 11)
    pos = torch.arange(a.seq, device=device).unsqueeze(0).expand(a.mbs, -1)
    ones = torch.ones(a.mbs, a.seq, device=device)
    while True:
        tok = torch.randint(0, a.vocab, (a.mbs, a.seq + 1), device=device, generator=gen)
        batch = dict(tokens=tok[:, :-1], labels=tok[:, 1:], loss_mask=ones, position_ids=pos)
        if a.documents:
            median, sigma = (float(x) for x in a.documents.split(":"))
            ids = [skewed_document_ids(a.seq, docs, median, sigma) for _ in range(a.mbs)]
            batch["document_ids"] = torch.stack(ids)  # [b, S]
        yield batch


class RandomTokens(DataCursor):
    """The trainer's training loader in a benchmark: `random_batches`' micro batches, each
    moving the global data cursor past one micro batch of every data-parallel rank (as the
    training loader does)."""

    def __init__(self, batches, samples_per_micro_batch: int):
        self.batches, self.samples = batches, samples_per_micro_batch

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        self._consumed += self.samples
        return next(self.batches)


def time_steps(step, sync, warmup: int, iters: int) -> tuple[list[float], list[float]]:
    """Seconds of each of `iters` steps after `warmup` steps, and of the warm-up steps."""
    times, warmup_times = [], []
    for i in range(warmup + iters):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        (times if i >= warmup else warmup_times).append(time.perf_counter() - t0)
    return times, warmup_times


def run_gpt_bench(a: argparse.Namespace, device) -> dict:
    """Build the job of `a` over every process, time its steps (and profile two under
    --profile), tear its groups down; the record that tools/bench_gpt.py prints."""
    if a.gemm_sm_carveout is not None:
        c10d_compat.set_sm_carveout(a.gemm_sm_carveout)
    world = dist.get_world_size()
    layout = Layout.from_world(world, a.tp, a.pp, a.vpp or 1, a.sp, cp=a.cp)
    layout.validate(num_layers=a.layers, num_attention_heads=a.heads, seq_length=a.seq)
    layout = dataclasses.replace(layout, distopt_instances=a.distopt_instances)  # or refused
    if a.cuda_graph:  # the trainer leaves a layout it cannot capture without a graph: refuse it
        recompute_kind = None if a.recompute == "none" else a.recompute
        check_cuda_graph(
            pp=a.pp, vpp=a.vpp or 1, dropout=0.0, recompute=recompute_kind, device=device
        )
    cfg = job_config(a)
    try:
        validate_sharding_strategy(cfg, layout)
    except ConfigError as err:
        raise SystemExit(f"tools/bench_gpt.py: error: {err}") from err
    groups = ParallelGroups.build(layout, range(world))
    trainer = Trainer(cfg, groups, device, print_fn=lambda *_, **__: None)
    data = random_batches(a, groups.dp_rank, device)
    trainer.parts.train_loader = RandomTokens(data, a.mbs * layout.dp)
    step = trainer.train_step
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # this run's peak, also after other runs

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times, warmup_times = time_steps(step, sync, a.warmup, a.iters)
    if a.profile:
        profile(a, step, sync)
    cuda = device.type == "cuda"
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    resident = torch.cuda.memory_allocated(device) / 2**30 if cuda else 0.0  # between steps
    mem = torch.tensor([peak, resident], device=device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    res = record(a, layout.dp, world, times, warmup_times, mem[0].item(), mem[1].item())
    # the CUDA graph goes before its communicators (NCCL waits for graphs that use them), and
    # the gradient hooks on the parameters, which would keep the whole job alive after this
    trainer.release()
    groups.destroy()
    return res


def _fp8_mode(a: argparse.Namespace) -> str | None:
    """'FORMAT/RECIPE', '+nocache' under --no-fp8-weight-cache; None without fp8."""
    if a.fp8_format is None:
        return None
    return f"{a.fp8_format}/{a.fp8_recipe}" + ("+nocache" if a.no_fp8_weight_cache else "")


def record(
    a, dp: int, world: int, times, warmup_times, peak_mem_gib: float, resident_gib: float = 0.0
) -> dict:
    """The reference script's fields: the run's shape, the median iteration, throughput and
    MFU by its FLOPs formula, peak memory (the maximum over ranks), and the memory held
    between steps (weights, gradients, optimizer state, CUDA graph pools)."""
    ordered = sorted(times)
    med = ordered[len(ordered) // 2]
    s, n_layers, h, B = a.seq, a.layers, a.hidden, a.gbs
    model = model_record(a)  # FLOPs by the model's formula (the reference one for GPT-2)
    tflops = model["flops_per_iter"] / med / world / 1e12
    return dict(
        framework="megadyn",
        tp=a.tp,
        pp=a.pp,
        vpp=a.vpp,
        dp=dp,
        distopt_instances=a.distopt_instances,
        precision_aware_optimizer=a.use_precision_aware_optimizer,
        sharding_strategy=a.data_parallel_sharding_strategy,
        sp=a.sp,
        cp=a.cp,
        cp_comm_type=a.cp_comm_type if a.cp > 1 else None,
        cp_placement=a.cp_placement if a.cp > 1 else None,
        cp_block_size=a.cp_block_size if a.cp > 1 and a.cp_placement != "static" else None,
        documents=a.documents,
        cuda_graph=a.cuda_graph,
        tp_comm_overlap=a.tp_comm_overlap,
        tp_comm_overlap_transport=a.tp_comm_overlap_transport if a.tp_comm_overlap else None,
        gemm_sm_carveout=a.gemm_sm_carveout,
        fp8=_fp8_mode(a),
        attn="sdpa",
        attention_backend=a.attention_backend,
        recompute=a.recompute,
        keep_fc2_input=a.keep_fc2_input,
        keep_norm_outputs=a.keep_norm_outputs,
        cross_entropy_chunks=a.cross_entropy_chunks or 1,
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
        peak_mem_gib=round(peak_mem_gib, 2),
        resident_mem_gib=round(resident_gib, 2),
        **model,
    )


def profile(a, step, sync) -> None:
    """Two profiled iterations; rank 0 writes a kernel summary, its trace and how much of the
    communication ran beside compute (trace_overlap.py) under `a.profile`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with torch_profile(activities=acts) as prof:
        for _ in range(2):
            step()
        sync()
    if dist.get_rank() != 0:
        return
    os.makedirs(a.profile, exist_ok=True)
    name = f"tp{a.tp}_pp{a.pp}{f'_cp{a.cp}' if a.cp > 1 else ''}{'_sp' if a.sp else ''}"
    if a.tp_comm_overlap:
        name += "_overlap" + ("_ce" if a.tp_comm_overlap_transport == "copy-engine" else "")
    name += "_graph" if a.cuda_graph else ""
    name += "_pointwise" if a.pointwise_fusion else ""
    name += f"_fp8_{a.fp8_format}_{a.fp8_recipe}" if a.fp8_format else ""
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
