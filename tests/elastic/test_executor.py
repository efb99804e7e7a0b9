"""The reshard executor on real model chunks and optimizers (gloo, 4 processes).

Old members build the model (layout-independent init from a seed) and a ZeRO-1 or plain
optimizer whose Adam state is loaded from synthetic global tensors; after `execute_plan` every
new member's tensors must equal what a model and optimizer built directly under the new layout
hold. The description's distributed-optimizer ranges are checked against the real shards.
"""

from __future__ import annotations

import torch

from megadyn.core.distributed import DistributedDataParallel
from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.core.optimizer import OptimizerConfig, build_optimizer
from megadyn.elastic import DistOpt, execute_plan, plan_reshard
from megadyn.models import GPTConfig, build_gpt_chunks
from megadyn.models.sharding import init_global, param_specs, tp_piece
from megadyn.testing.spawn import spawn

CFG = GPTConfig.gpt2(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=100,
    make_vocab_size_divisible_by=8,
    max_position_embeddings=16,
)
SEED, BUCKET = 1234, 300
SCALARS = {"scalar.train_state": ((4,), torch.int64), "scalar.rng": ((16,), torch.uint8)}
SCALAR_VALUES = {
    "scalar.train_state": torch.tensor([7, 448, 1, 0]),
    "scalar.rng": torch.arange(16, dtype=torch.uint8),
}
# (old layout, old members, old distopt) -> (new layout, new members, new distopt). Members are
# in ascending order within every tp and dp group (pipeline order is free): core's tp layers and
# DDP buckets take a rank's index in the process group, which torch orders by global rank.
SCENARIOS = [
    ((Layout(tp=2, pp=2), [2, 3, 0, 1], True), (Layout(dp=4), [0, 1, 2, 3], True)),
    ((Layout(tp=2), [0, 2], False), (Layout(pp=2, vpp=2), [2, 1], True)),
    ((Layout(pp=2, dp=2, vpp=2), [2, 3, 0, 1], True), (Layout(tp=2, dp=2), [0, 1, 2, 3], False)),
]


def synthetic(name: str, key: str) -> torch.Tensor:
    """Global value of optimizer state `key` of weight `name` (unique values for moments)."""
    spec = param_specs(CFG)[name]
    if key == "main":
        return init_global(spec, CFG, SEED)
    n = torch.Size(spec.shape).numel()
    scale = 1.0 if key == "exp_avg" else 2.0
    return (torch.arange(n, dtype=torch.float32) * scale + 0.5).view(spec.shape)


def build(groups, distopt: bool):
    chunks = build_gpt_chunks(CFG, groups, seed=SEED)
    ddp = [
        DistributedDataParallel(
            c, groups.dp_group, use_distributed_optimizer=distopt, bucket_size=BUCKET
        )
        for c in chunks
    ]
    opt = build_optimizer(chunks, ddp, groups, OptimizerConfig(use_distributed_optimizer=distopt))
    params = {n: p for c in chunks for n, p in c.named_parameters()}
    for name, param in params.items():
        piece = tp_piece(param_specs(CFG)[name], CFG, groups.tp_size, groups.tp_rank)
        state = {k: piece.take(synthetic(name, k)) for k in ("main", "exp_avg", "exp_avg_sq")}
        opt.load_param_state(param, state)
    return params, opt


def optim_local(opt, param, key: str, distopt: bool) -> torch.Tensor | None:
    """This rank's optimizer state for `param`: its flat shard, or the full local tensor."""
    if not distopt:
        return opt.param_state(param)[key]
    start, end = opt.shard_range(param)
    return opt.shard_state(param)[key] if end > start else None


def local_getter(params, opt, distopt: bool):
    """`get_local` of the executor over this rank's old params and optimizer."""

    def get_local(key: str) -> torch.Tensor:
        if key.startswith("scalar."):
            return SCALAR_VALUES[key]
        kind, rest = key.split(".", 1)
        if kind == "model":
            return params[rest].detach()
        name, sub = rest.rsplit(".", 1)
        return optim_local(opt, params[name], sub, distopt)

    return get_local


def check_ranges(desc, rank, params, opt) -> None:
    """The description's distributed-optimizer ranges are the real optimizer's shards."""
    held = desc.held(rank)
    for name, param in params.items():
        piece = held.get(f"optim.{name}.exp_avg")
        got = (0, 0) if piece is None else (piece.start, piece.end)
        assert got == opt.shard_range(param), name


def _reshard(rank, world):
    for (old_layout, old_members, old_do), (new_layout, new_members, new_do) in SCENARIOS:
        old_groups = ParallelGroups.build(old_layout, old_members)
        new_groups = ParallelGroups.build(new_layout, new_members)
        plan = plan_reshard(
            CFG, old_layout, old_members, new_layout, new_members,
            old_distopt=DistOpt(BUCKET) if old_do else None,
            new_distopt=DistOpt(BUCKET) if new_do else None,
            scalars=SCALARS,
        )  # fmt: skip
        get_local = None
        if old_groups.is_member:
            params, opt = build(old_groups, old_do)
            if old_do:
                check_ranges(plan.old, rank, params, opt)

            get_local = local_getter(params, opt, old_do)

        got = execute_plan(plan, get_local, round_bytes=4096)
        if new_groups.is_member:
            params, opt = build(new_groups, new_do)
            if new_do:
                check_ranges(plan.new, rank, params, opt)
            want = dict(SCALAR_VALUES)
            for name, param in params.items():
                want[f"model.{name}"] = param.detach()
                for k in ("main", "exp_avg", "exp_avg_sq"):
                    value = optim_local(opt, param, k, new_do)
                    if value is not None:
                        want[f"optim.{name}.{k}"] = value
            assert sorted(got) == sorted(want)
            for key, value in want.items():
                assert got[key].shape == value.shape and torch.equal(got[key], value), key
        else:
            assert got == {}
        dist_barrier()
        new_groups.destroy()
        old_groups.destroy()
    return True


def dist_barrier() -> None:
    torch.distributed.barrier()


def test_executor_reshards_real_model_state():
    assert spawn(_reshard, world=4, timeout_s=90) == [True] * 4
