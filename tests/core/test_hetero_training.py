"""Replicas of different pipeline depth train as one process does (gloo, fp32).

5 processes as one 3-stage and one 2-stage pipeline (with and without the distributed
optimizer, whose shards follow each layer range's reduce group), 7 processes as the
heterogeneous planner's mix, and tp 2 x (2 + 1 stages) with the distributed optimizer, each
run 2 optimizer steps; every micro batch's loss equals the
single-process run's within 1e-5, the gradient norm the single process's, and every sample of
every step is read by exactly one replica.
"""

from __future__ import annotations

import dataclasses

import torch
from pipeline_helpers import loss_fn, make_cfg

from megadyn.core.distributed import finalize_model_grads
from megadyn.core.groups import ParallelGroups
from megadyn.core.hetero_groups import HeteroGroups, reduce_hetero_grads
from megadyn.core.hetero_layout import HeteroLayout, Replica
from megadyn.core.layout import Layout
from megadyn.core.optimizer import OptimizerConfig
from megadyn.core.pipeline import forward_backward
from megadyn.core.recompute import RecomputeConfig
from megadyn.elastic.planning.hetero import HeteroPlanner
from megadyn.elastic.planning.layouts import LayoutPlanner
from megadyn.elastic.reshard.description import DistOpt
from megadyn.elastic.reshard.hetero_description import describe_hetero
from megadyn.testing.spawn import spawn
from megadyn.training.build import build_model_parts, no_sync
from megadyn.training.config import MegadynConfig, TrainingConfig
from megadyn.training.tensors import export_tensors

SEQ, MBS, MICRO, STEPS, LAYERS = 8, 2, 8, 2, 6
MODEL = make_cfg("gpt2", LAYERS, seq=SEQ)
CFG = MegadynConfig(
    model=MODEL,
    training=TrainingConfig(micro_batch_size=MBS, global_batch_size=MBS * MICRO, seed=7),
    optimizer=OptimizerConfig(lr=1e-2, clip_grad=1.0),
)
DISTOPT = dataclasses.replace(
    CFG, optimizer=dataclasses.replace(CFG.optimizer, use_distributed_optimizer=True)
)


def sample(index: int) -> dict:
    """Sample `index` of the data set: a function of its index only."""
    g = torch.Generator().manual_seed(index)
    return dict(
        tokens=torch.randint(0, MODEL.vocab_size, (SEQ,), generator=g),
        labels=torch.randint(0, MODEL.vocab_size, (SEQ,), generator=g),
        loss_mask=(torch.rand(SEQ, generator=g) > 0.2).float(),
        position_ids=torch.arange(SEQ),
    )


def micro_batches(step: int, first: int, count: int, read: list | None):
    """Micro batches first .. first + count - 1 of `step`; their sample indices go to `read`."""
    for j in range(first, first + count):
        indices = [(step * MICRO + j) * MBS + i for i in range(MBS)]
        if read is not None:
            read += indices
        samples = [sample(i) for i in indices]
        yield {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def train(parts, groups, steps, draw, count: int, share: float, finalize) -> list[list[float]]:
    """Per step, the micro batches' losses (last stages) and, last, the gradient norm."""
    losses = []
    for step in range(steps):
        parts.optimizer.zero_grad()
        out = forward_backward(
            parts.ddp,
            groups,
            draw(step),
            count,
            config=parts.pipeline_cfg,
            loss_fn=loss_fn,
            no_sync=lambda: no_sync(parts.ddp),
            loss_scale=share,
        )
        finalize()
        norm = parts.optimizer.step().grad_norm
        losses.append([float(x) for x in out] + [norm])
    return losses


def _train_hetero(layout: HeteroLayout, cfg: MegadynConfig) -> dict:
    """Train under `layout` (or only build its groups, on a rank outside it)."""
    hetero = HeteroGroups.build(layout, backend="gloo")
    if not hetero.is_member:
        hetero.destroy()
        return {}
    cpu = torch.device("cpu")
    parts = build_model_parts(cfg, MODEL, hetero, cpu)
    distopt = DistOpt() if cfg.optimizer.use_distributed_optimizer else None
    described = describe_hetero(MODEL, layout, distopt=distopt).held(hetero.rank)
    exported = export_tensors(parts.chunks, parts.optimizer, cfg.optimizer)
    exported = {k: t for k, t in exported.items() if t.numel()}  # not its empty shards
    assert {k: t.numel() for k, t in exported.items()} == {  # as the description says
        k: p.numel for k, p in described.items()
    }
    read: list[int] = []
    first = hetero.replica.is_first_stage and hetero.tp_rank == 0  # one reader per replica
    offset, count = hetero.microbatch_offset, hetero.micro_batches
    losses = train(
        parts,
        hetero.replica,
        STEPS,
        lambda step: micro_batches(step, offset, count, read if first else None),
        count,
        hetero.batch_share,
        lambda: reduce_hetero_grads(parts.ddp, hetero),
    )
    last = hetero.replica.is_last_stage
    state_bytes = sum(  # the Adam moments (fp32 main weights are the params themselves here)
        t.numel() * t.element_size() for k, t in exported.items() if k.endswith(("_avg", "_sq"))
    )
    hetero.destroy()
    return dict(read=read, offset=offset, losses=losses, last=last, state_bytes=state_bytes)


def _run(rank, world, runs: list[tuple[HeteroLayout, MegadynConfig]]):
    results = [_train_hetero(layout, cfg) for layout, cfg in runs]
    single = ParallelGroups.build(Layout(), members=[0], backend="gloo")
    reference = None
    if rank == 0:  # the single-process run, through the same builders
        ref = build_model_parts(CFG, MODEL, single, torch.device("cpu"))
        reference = train(
            ref,
            single,
            STEPS,
            lambda step: micro_batches(step, 0, MICRO, None),
            MICRO,
            1.0,
            lambda: finalize_model_grads(ref.ddp, single),
        )
    single.destroy()
    return results, reference


def three_plus_two() -> HeteroLayout:
    r = range
    return HeteroLayout(
        tp=1,
        num_layers=LAYERS,
        replicas=(
            Replica((r(0, 2), r(2, 4), r(4, 6)), (0, 1, 2), micro_batches=5),
            Replica((r(0, 4), r(4, 6)), (3, 4), micro_batches=3),
        ),
    )


def tp_two_plus_one() -> HeteroLayout:
    """tp 2: a 2-stage and a 1-stage replica, ranks out of order (as after a standby took a
    place), so the tp ranks of a stage own different parts of their reduce groups' buffers."""
    r = range
    return HeteroLayout(
        tp=2,
        num_layers=LAYERS,
        replicas=(
            Replica((r(0, 3), r(3, 6)), (0, 5, 1, 2), micro_batches=5),
            Replica((r(0, 6),), (3, 4), micro_batches=3),
        ),
    )


def planned_seven() -> HeteroLayout:
    """The planner's mix for 7 members, with a memory limit that a 1-stage replica exceeds."""
    rc = RecomputeConfig()
    planner = LayoutPlanner(
        MODEL,
        global_batch_size=MBS * MICRO,
        seq_length=SEQ,
        gpu_memory_gib=1.0,
        distributed_optimizer=False,
        micro_batch_sizes=(MBS,),
        recomputes=(rc,),
    )
    hetero = HeteroPlanner(planner)
    one, two = (max(hetero.template(1, MBS, rc, 1, s).stage_gib) for s in (1, 2))
    planner.gpu_memory_gib = (one + two) / 2
    hetero = HeteroPlanner(planner)
    plan = hetero.plan(7)
    assert plan.members_used == 7 and min(t.num_stages for t in plan.templates) >= 2
    return plan.layout(range(7), LAYERS)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def test_heterogeneous_replicas_train_as_one_process():
    # one job of 7: ranks outside a layout wait out its run
    runs = [(three_plus_two(), CFG), (three_plus_two(), DISTOPT), (planned_seven(), CFG)]
    runs.append((tp_two_plus_one(), DISTOPT))
    for layout, _ in runs:
        assert len({rep.num_stages for rep in layout.replicas}) > 1  # depths differ
    results = spawn(_run, world=7, args=(runs,), timeout_s=300)
    reference = results[0][1]
    for res, _ in results:  # the same replicas with and without ZeRO-1: the same numbers
        if res[0]:
            for without, sharded in zip(res[0]["losses"], res[1]["losses"], strict=True):
                assert all(map(close, sharded, without)), (sharded, without)
    per_run = []
    for n, (layout, _) in enumerate(runs):
        ranks = [res[n] for res, _ in results if res[n]]
        assert len(ranks) == layout.world_size
        for step in range(STEPS):
            got = {}
            for res in ranks:
                if res["last"]:
                    for k, loss in enumerate(res["losses"][step][:-1]):
                        got[res["offset"] + k] = loss
            assert sorted(got) == list(range(MICRO)), layout.describe()
            for j, loss in got.items():
                assert close(loss, reference[step][j]), (n, step, j)
            for res in ranks:  # every rank steps with the one process's gradient norm
                assert close(res["losses"][step][-1], reference[step][-1]), (n, step)
        read = sorted(i for res in ranks for i in res["read"])
        assert read == list(range(STEPS * MICRO * MBS))  # every sample once
        per_run.append([res["state_bytes"] for res in ranks])
    whole, sharded = per_run[0], per_run[1]  # 3 + 2 stages without and with ZeRO-1
    print(f"Adam state bytes per rank, 3 + 2 stages: {whole}; distributed optimizer: {sharded}")
    assert sum(sharded) < sum(whole) and max(sharded) < max(whole)
