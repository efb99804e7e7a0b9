"""HeteroLayout: replicas of different depth, and the ranks that reduce each weight's gradients."""

import pytest

from megadyn.core.hetero_layout import HeteroLayout, Replica
from megadyn.core.layout import Layout, LayoutError, RankGrid


def five_as_three_plus_two(tp: int = 1) -> HeteroLayout:
    r = range
    ranks = list(range(5 * tp))
    return HeteroLayout(
        tp=tp,
        num_layers=6,
        replicas=(
            Replica((r(0, 2), r(2, 4), r(4, 6)), tuple(ranks[: 3 * tp]), micro_batches=5),
            Replica((r(0, 3), r(3, 6)), tuple(ranks[3 * tp :]), micro_batches=3),
        ),
    )


def test_five_members_as_a_three_and_a_two_stage_pipeline():
    lay = five_as_three_plus_two()
    assert lay.world_size == 5 and lay.num_microbatches == 8
    assert lay.layer_ranges() == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]
    groups = {g.part: g.ranks for g in lay.reduce_groups()}
    assert groups == {
        range(0, 2): (0, 3),
        range(2, 3): (1, 3),
        range(3, 4): (1, 4),
        range(4, 6): (2, 4),
        "word_embeddings": (0, 2, 3, 4),  # tied: first and last stages
        "position_embeddings": (0, 3),
        "final_layernorm": (2, 4),
    }
    assert lay.coords_of(4) == (1, 1, 0) and lay.microbatch_offset(1) == 5
    assert lay.replica_layout(0) == Layout(pp=3) and lay.replica_layout(1) == Layout(pp=2)
    assert [g.part for g in lay.groups_of(3)] == [
        range(0, 2),
        range(2, 3),
        "word_embeddings",
        "position_embeddings",
    ]


def test_tensor_parallel_ranks_reduce_with_their_own_tp_rank():
    lay = five_as_three_plus_two(tp=2)  # replica 0: ranks 0-5, replica 1: ranks 6-9
    groups = {(g.part, g.tp_rank): g.ranks for g in lay.reduce_groups()}
    assert groups[range(2, 3), 0] == (2, 6) and groups[range(2, 3), 1] == (3, 7)
    assert groups["final_layernorm", 1] == (5, 9)


def test_every_layer_is_reduced_once_over_one_rank_per_replica():
    lay = HeteroLayout(
        tp=1,
        num_layers=7,
        replicas=(
            Replica((range(0, 2), range(2, 5), range(5, 7)), (0, 1, 2), 4),
            Replica((range(0, 4), range(4, 7)), (3, 4), 3),
            Replica((range(0, 3), range(3, 7)), (5, 6), 3),
        ),
        tied_embeddings=False,
    )
    layer_groups = [g for g in lay.reduce_groups() if isinstance(g.part, range)]
    covered = [layer for g in layer_groups for layer in g.part]
    assert covered == list(range(7))
    for g in layer_groups:
        holders = {lay.coords_of(rank).replica for rank in g.ranks}
        assert holders == {0, 1, 2} and len(g.ranks) == 3
    words = next(g for g in lay.reduce_groups() if g.part == "word_embeddings")
    assert words.ranks == (0, 3, 5)  # untied: first stages only


def test_a_grid_is_a_layout_of_equal_replicas():
    layout = Layout(tp=2, pp=2, dp=2)
    members = tuple(range(8))
    lay = HeteroLayout.from_grid(layout, members, num_layers=4, num_microbatches=3)
    grid = RankGrid(layout, members)
    by_range = {(g.part, g.tp_rank): list(g.ranks) for g in lay.reduce_groups()}
    for pp_rank, layers in enumerate((range(0, 2), range(2, 4))):
        for tp_rank in range(2):
            dp_group = next(
                g for g in grid.dp_groups() if grid.coords_of(g[0])[::2] == (tp_rank, pp_rank)
            )
            assert by_range[layers, tp_rank] == dp_group
    assert lay.num_microbatches == 6


def test_refuses_what_cannot_run():
    r = range
    with pytest.raises(LayoutError, match="consecutive"):
        HeteroLayout(1, 4, (Replica((r(0, 2), r(3, 4)), (0, 1), 1),))
    with pytest.raises(LayoutError, match="--tensor-model-parallel-size"):
        HeteroLayout(2, 4, (Replica((r(0, 4),), (0,), 1),))
    with pytest.raises(LayoutError, match="repeat"):
        HeteroLayout(1, 4, (Replica((r(0, 4),), (0,), 1), Replica((r(0, 4),), (0,), 1)))
    with pytest.raises(LayoutError, match="no micro batch"):
        HeteroLayout(1, 4, (Replica((r(0, 4),), (0,), 0),))
