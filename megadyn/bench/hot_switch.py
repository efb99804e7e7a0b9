"""Two ways to move a hot switch's tensors, timed and compared (tools/bench_hot_switch.py).

A hot switch (megadyn/training/hot_switch.py) moves the weights from the base layout (dp N)
into a layout of tp N over the same ranks and the gradients back. Two mechanisms can do it:

- gather: `LayoutSwitch` (megadyn/training/layout_switch.py): a local slice for the weights
  (the base holds whole tensors), one all-gather per bucket over tp for the gradients;
- reshard: the live reshard's planner and executor (megadyn/elastic/reshard/plan.py, executor.py)
  on the weights' part of the state description (the gradients described as fp32), plan made
  once, batched point-to-point transfers each time.

Each is run `repeats` times after one warm-up; the moved weights and the gradients added to the
base buffers must be bit-equal between the two. One JSON line per mechanism on rank 0.

    torchrun --nproc-per-node 2 tools/bench_hot_switch.py --layers 24 --hidden 2048 \
        --heads 16 --ffn 8192 --vocab 50303 --bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import zlib

import torch
import torch.distributed as dist

from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.elastic.reshard.description import StateDescription, TensorInfo, describe
from megadyn.elastic.reshard.executor import execute_plan
from megadyn.elastic.reshard.plan import plan_between
from megadyn.launch.distributed_init import init_distributed
from megadyn.models import build_gpt_chunks
from megadyn.models.config import GPTConfig
from megadyn.models.sharding import param_specs, tp_piece
from megadyn.training.layout_switch import LayoutSwitch


def weights_only(desc: StateDescription, dtype: torch.dtype | None = None) -> StateDescription:
    """The `model.*` part of a state description (its tensors re-typed to `dtype` if given)."""
    tensors = {
        k: TensorInfo(v.shape, dtype or v.dtype)
        for k, v in desc.tensors.items()
        if k[:6] == "model."
    }
    pieces = {r: [p for p in ps if p.key in tensors] for r, ps in desc.pieces.items()}
    return StateDescription(tensors, pieces)


def _global_grad(name: str, shape, device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen, device=device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeats: int) -> float:
    fn()  # warm-up (communicators, allocations)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def run(cfg: GPTConfig, device: torch.device | str, repeats: int = 3) -> list[dict]:
    """Both mechanisms between dp N and tp N over all ranks; rows on rank 0 (module doc)."""
    device = torch.device(device)
    world = dist.get_world_size()
    members = list(range(world))
    base_layout, other_layout = Layout(dp=world), Layout(tp=world)
    base = ParallelGroups.build(base_layout, members)
    other = ParallelGroups.build(other_layout, members)
    base_chunk = build_gpt_chunks(cfg, base, seed=1, device=device)[0]
    copies = [build_gpt_chunks(cfg, other, device=device)[0] for _ in range(2)]
    specs = param_specs(cfg)
    for copy in copies:  # the other layout's final gradients: pieces of one global tensor
        for name, p in copy.named_parameters():
            whole = _global_grad(name, specs[name].shape, device)
            p.main_grad = tp_piece(specs[name], cfg, world, other.tp_rank).take(whole).clone()
    base_params = dict(base_chunk.named_parameters())
    grads = [
        {n: torch.zeros_like(p, dtype=torch.float32) for n, p in base_params.items()}
        for _ in range(2)
    ]

    gather = LayoutSwitch(cfg, base_chunk, base, copies[0], other)
    rows = [dict(path="gather")]
    rows[0]["weights_ms"] = 1e3 * _timed(gather.weights_to_other, device, repeats)
    for n, p in base_params.items():
        p.main_grad = grads[0][n]
    rows[0]["grads_ms"] = 1e3 * _timed(gather.grads_to_base, device, repeats)

    start = time.perf_counter()
    old = describe(cfg, base_layout, members)
    new = describe(cfg, other_layout, members)
    to_other = plan_between(weights_only(old), weights_only(new))
    back = plan_between(weights_only(new, torch.float32), weights_only(old, torch.float32))
    plan_ms = 1e3 * (time.perf_counter() - start)
    other_params = dict(copies[1].named_parameters())

    @torch.no_grad()
    def weights() -> None:
        out = execute_plan(to_other, lambda k: base_params[k[6:]], device=device)
        for key, tensor in out.items():
            other_params[key[6:]].copy_(tensor.view(other_params[key[6:]].shape))

    @torch.no_grad()
    def grads_back() -> None:
        out = execute_plan(back, lambda k: other_params[k[6:]].main_grad, device=device)
        for key, tensor in out.items():
            grads[1][key[6:]].add_(tensor.view(grads[1][key[6:]].shape))

    rows.append(dict(path="reshard", plan_ms=plan_ms))
    rows[1]["weights_ms"] = 1e3 * _timed(weights, device, repeats)
    rows[1]["grads_ms"] = 1e3 * _timed(grads_back, device, repeats)
    same_weights = all(
        torch.equal(a, b) for a, b in zip(copies[0].parameters(), copies[1].parameters())
    )
    same_grads = all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    flags = torch.tensor([same_weights and same_grads], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    numel = sum(p.numel() for p in base_params.values())
    for row in rows:
        row.update(ranks=world, params=numel, repeats=repeats, bit_equal=bool(flags.item()))
    other.destroy()
    base.destroy()
    return rows if dist.get_rank() == 0 else []


def model_config(layers, hidden, heads, ffn, vocab, bf16: bool) -> GPTConfig:
    cfg = GPTConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
        max_position_embeddings=2048,
        untie_embeddings_and_output_weights=True,
    )
    return dataclasses.replace(cfg, params_dtype=torch.bfloat16) if bf16 else cfg


def print_rows(rows: list[dict]) -> None:
    for row in rows:
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))


def main(argv=None) -> None:
    """tools/bench_hot_switch.py (python -m megadyn.bench hot_switch): one JSON line per row."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=50303)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    device = init_distributed()
    cfg = model_config(a.layers, a.hidden, a.heads, a.ffn, a.vocab, a.bf16)
    print_rows(run(cfg, device, a.repeats))
    dist.destroy_process_group()
