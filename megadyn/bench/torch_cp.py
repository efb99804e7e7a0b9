"""torch's own context parallelism on the reference GPT shape: the comparison row of
megadyn/bench/cp_compare.py.

    record = run_torch_cp_bench(a, device)    # a: megadyn/bench/gpt.py's arguments (seq, gbs, ...)

A plain GPT of the reference shape (learned positions, pre-LayerNorm blocks, GELU MLP, untied
output layer), its attention torch's SDPA with the flash kernel, run under
torch.distributed.tensor.experimental.context_parallel over every rank (head-tail load
balancing, keys and values all-gathered: torch's default rotation) with FSDP2 sharding the fp32
weights over the same ranks (bf16 compute, fp32 gradient reduction), as torchtitan runs a job
whose only parallelism is cp. AdamW, lr 1e-4; full recomputation wraps each block in
torch.utils.checkpoint. Tokens, labels and positions are the buffers cp shards.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megadyn.bench.gpt import random_batches, record, time_steps


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [b, s, h]
        b, s, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [b, n, s, d]
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, n, s, d]
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, a: argparse.Namespace):
        super().__init__()
        self.recompute = a.recompute == "full"
        self.tok, self.pos = nn.Embedding(a.vocab, a.hidden), nn.Embedding(a.seq, a.hidden)
        self.blocks = nn.ModuleList(Block(a.hidden, a.heads, 4 * a.hidden) for _ in range(a.layers))
        self.ln_f, self.head = nn.LayerNorm(a.hidden), nn.Linear(a.hidden, a.vocab, bias=False)

    def forward(self, tokens, positions, labels) -> torch.Tensor:  # [b, s] each
        x = self.tok(tokens) + self.pos(positions)  # [b, s, h]
        for block in self.blocks:
            if self.recompute:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))  # [b, s, V]
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def build(a: argparse.Namespace, device):
    """The model sharded by FSDP2 over a one-dimensional mesh of every rank, its optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("cp",))
    torch.manual_seed(1234)
    model = PlainGPT(a).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return mesh, model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def run_torch_cp_bench(a: argparse.Namespace, device) -> dict:
    """Time torch's context-parallel step on the shape of `a`; the record of gpt.py's fields."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    set_rotate_method("allgather")
    mesh, model, opt = build(a, device)
    data = random_batches(a, 0, device)  # every rank reads the same sequences
    num_micro = a.gbs // a.mbs

    def step():
        opt.zero_grad(set_to_none=True)
        for _ in range(num_micro):
            batch = next(data)
            bufs = [batch["tokens"].clone(), batch["position_ids"].clone(), batch["labels"].clone()]
            with (
                context_parallel(mesh, buffers=bufs, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(bufs)),
                sdpa_kernel(SDPBackend.FLASH_ATTENTION),
            ):  # fmt: skip
                loss = model(*bufs) / num_micro
                loss.backward()
        opt.step()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, warmup_times = time_steps(step, sync, a.warmup, a.iters)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    mem = torch.tensor([peak], device=device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    res = record(a, 1, dist.get_world_size(), times, warmup_times, mem.item())
    res.update(framework="torch_cp", cp=dist.get_world_size(), cp_comm_type="allgather", tp=1)
    return res
