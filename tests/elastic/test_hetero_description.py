"""The state description of heterogeneous layouts: plans between grids and templates deliver
every piece exactly once (pure, no processes)."""

from __future__ import annotations

import math

import pytest
from test_planner import GPT2, LLAMA, SCALARS, simulate

from megadyn.core.hetero_layout import HeteroLayout, Replica
from megadyn.core.layout import Layout
from megadyn.elastic import describe, plan_between
from megadyn.elastic.reshard.description import DistOpt
from megadyn.elastic.reshard.hetero_description import describe_hetero

UNTIED = LLAMA.with_(untie_embeddings_and_output_weights=True)


def hetero(cfg, tp: int, *replica_cuts: tuple[int, ...]) -> HeteroLayout:
    """Replicas cut at the given layer indices (8 layers), ranks handed out in order."""
    replicas, rank = [], 0
    for cuts in replica_cuts:
        bounds = (0, *cuts, 8)
        stages = tuple(range(a, b) for a, b in zip(bounds, bounds[1:]))
        size = len(stages) * tp
        replicas.append(Replica(stages, tuple(range(rank, rank + size)), 1))
        rank += size
    tied = not cfg.untie_embeddings_and_output_weights
    return HeteroLayout(tp, 8, tuple(replicas), tied_embeddings=tied)


@pytest.mark.parametrize("cfg", [GPT2, UNTIED], ids=["gpt2-tied", "llama-untied"])
@pytest.mark.parametrize("tp", [1, 2])
def test_grid_to_templates_and_back(cfg, tp):
    grid = describe(cfg, Layout(tp=tp, pp=2, dp=2), range(4 * tp), scalars=SCALARS)
    five = describe_hetero(cfg, hetero(cfg, tp, (3, 6), (5,)), scalars=SCALARS)  # 3 + 2 stages
    three = describe_hetero(cfg, hetero(cfg, tp, (2,), ()), scalars=SCALARS)  # 2 + 1 stages
    back = describe(cfg, Layout(tp=tp, dp=2), range(2 * tp), scalars=SCALARS)
    for old, new in ((grid, five), (five, three), (three, back)):
        simulate(plan_between(old, new))  # every new piece exact, each element once
    for desc, layout in ((five, hetero(cfg, tp, (3, 6), (5,))), (three, hetero(cfg, tp, (2,), ()))):
        for rep in layout.replicas:  # each replica holds the whole state
            keys = {k for r in rep.members for k in desc.held(r)}
            assert keys == set(desc.tensors)


def test_a_stage_holds_its_layers_and_ends():
    lay = hetero(GPT2, 1, (3, 6), (5,))
    held = describe_hetero(GPT2, lay).held
    layers = lambda rank: sorted(  # noqa: E731
        {int(k.split(".")[3]) for k in held(rank) if k.startswith("model.decoder.layers.")}
    )
    assert [layers(r) for r in range(5)] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7],
        [0, 1, 2, 3, 4],
        [5, 6, 7],
    ]
    word = "model.embedding.word_embeddings.weight"
    assert [word in held(r) for r in range(5)] == [True, False, True, True, True]  # tied
    assert "optim.decoder.final_layernorm.weight.exp_avg" in held(4)
    assert "model.embedding.position_embeddings.weight" not in held(4)


@pytest.mark.parametrize("tp", [1, 2])
def test_distributed_optimizer_shards_follow_the_reduce_groups(tp):
    """Grid -> 3 + 2 -> 2 + 1 -> grid with every optimizer shard flat: each element of each
    optimizer tensor is held once per layout (a reduce group's ranks split it), and the
    plans deliver every piece exactly."""
    on = DistOpt(bucket_size=None)
    layouts = [hetero(GPT2, tp, (3, 6), (5,)), hetero(GPT2, tp, (2,), ())]
    grid = describe(GPT2, Layout(tp=tp, pp=2, dp=2), range(4 * tp), distopt=on, scalars=SCALARS)
    five, three = (describe_hetero(GPT2, lay, distopt=on, scalars=SCALARS) for lay in layouts)
    back = describe(GPT2, Layout(tp=tp, dp=2), range(2 * tp), distopt=on, scalars=SCALARS)
    for old, new in ((grid, five), (five, three), (three, back), (five, back)):
        simulate(plan_between(old, new))
    for desc in (five, three):
        held, copies = {}, {}  # key -> element count over every rank; tp copies of it
        for pieces in desc.pieces.values():
            for p in pieces:
                if p.key.startswith("optim."):
                    held[p.key] = held.get(p.key, 0) + p.numel
                    whole = p.sizes == desc.tensors[p.key].shape  # replicated over tp
                    copies[p.key] = tp if whole else 1
        for key, count in held.items():  # the replicas' shards: each element once per copy
            assert count == math.prod(desc.tensors[key].shape) * copies[key], key
    word = "optim.embedding.word_embeddings.weight.main"  # tied: first and last stages split it
    assert sum(word in five.held(r) for r in range(5 * tp)) == 4 * tp
