"""Rank arithmetic of layouts, without processes."""

import pytest

from megadyn.core.layout import Coords, Layout, LayoutError, RankGrid, chunk_layer_range


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 2), (2, 2, 2), (1, 4, 2), (4, 2, 1)])
def test_megatron_rank_order_and_partition(tp, pp, dp):
    layout = Layout(tp=tp, pp=pp, dp=dp)
    members = tuple(range(100, 100 + layout.world_size))
    grid = RankGrid(layout, members)
    for pos, rank in enumerate(members):
        c = grid.coords_of(rank)
        assert pos == c.tp + c.dp * tp + c.pp * tp * dp
        assert grid.rank_of(c) == rank
    for groups, size in (
        (grid.tp_groups(), tp),
        (grid.dp_groups(), dp),
        (grid.pp_groups(), pp),
        (grid.mp_groups(), tp * pp),
    ):
        flat = sorted(r for g in groups for r in g)
        assert flat == sorted(members)  # each kind partitions the members
        assert all(len(g) == size for g in groups)
    # ranks of one tp group are consecutive members (tp fastest)
    assert grid.tp_groups()[0] == list(members[:tp])


def test_canonical_members_sort_within_stages():
    from megadyn.core.layout import canonical_members

    # tp and dp groups ascend (torch numbers group ranks in ascending order); stage order kept
    assert canonical_members(Layout(tp=2, pp=2), (7, 3, 5, 1)) == (3, 7, 1, 5)
    assert canonical_members(Layout(tp=2, dp=2), (7, 3, 5, 1)) == (1, 3, 5, 7)


def test_members_may_be_any_subset_in_any_order():
    grid = RankGrid(Layout(tp=2, dp=2), (7, 3, 5, 1))
    assert grid.tp_groups() == [[7, 3], [5, 1]]
    assert grid.dp_groups() == [[7, 5], [3, 1]]
    assert grid.coords_of(5) == Coords(tp=0, dp=1, pp=0)


def test_interleaved_chunks_round_robin():
    layout = Layout(pp=2, vpp=2)
    assert list(chunk_layer_range(layout, 8, pp_rank=0, chunk=0)) == [0, 1]
    assert list(chunk_layer_range(layout, 8, pp_rank=1, chunk=0)) == [2, 3]
    assert list(chunk_layer_range(layout, 8, pp_rank=0, chunk=1)) == [4, 5]
    assert list(chunk_layer_range(layout, 8, pp_rank=1, chunk=1)) == [6, 7]


@pytest.mark.parametrize(
    "kwargs,layout,flag",
    [
        (dict(num_layers=4, num_attention_heads=6), Layout(tp=4), "--tensor-model-parallel-size"),
        (dict(num_layers=6, num_attention_heads=4), Layout(pp=4), "--pipeline-model-parallel-size"),
        (
            dict(num_layers=8, num_attention_heads=4),
            Layout(pp=2, vpp=3),
            "--num-layers-per-virtual-pipeline-stage",
        ),
        (
            dict(num_layers=4, num_attention_heads=4, global_batch_size=6, micro_batch_size=2),
            Layout(dp=2),
            "--global-batch-size",
        ),
        (
            dict(num_layers=4, num_attention_heads=4, num_query_groups=1),
            Layout(tp=2),
            "--num-query-groups",
        ),
    ],
)
def test_validation_names_the_flag(kwargs, layout, flag):
    with pytest.raises(LayoutError, match=flag):
        layout.validate(**kwargs)


def test_bad_layouts_refused():
    with pytest.raises(LayoutError, match="--sequence-parallel"):
        Layout(tp=1, sequence_parallel=True)
    with pytest.raises(LayoutError, match="needs 4 ranks"):
        RankGrid(Layout(tp=2, dp=2), (0, 1, 2))
    with pytest.raises(LayoutError, match="--pipeline-model-parallel-size"):
        Layout.from_world(6, tp=2, pp=2)


@pytest.mark.parametrize("tp,cp,dp,pp", [(1, 2, 1, 1), (2, 2, 2, 1), (1, 4, 1, 2), (2, 2, 1, 2)])
def test_context_parallel_rank_order_and_groups(tp, cp, dp, pp):
    layout = Layout(tp=tp, cp=cp, dp=dp, pp=pp)
    members = tuple(range(10, 10 + layout.world_size))
    grid = RankGrid(layout, members)
    for pos, rank in enumerate(members):
        c = grid.coords_of(rank)
        assert pos == c.tp + c.cp * tp + c.dp * tp * cp + c.pp * tp * cp * dp  # Megatron's order
        assert grid.rank_of(c) == rank
    for groups, size in (
        (grid.tp_groups(), tp),
        (grid.cp_groups(), cp),
        (grid.dp_groups(), dp),
        (grid.dp_cp_groups(), dp * cp),
        (grid.pp_groups(), pp),
        (grid.mp_groups(), tp * pp),
    ):
        assert sorted(r for g in groups for r in g) == sorted(members)
        assert all(len(g) == size for g in groups)
    for group in grid.dp_cp_groups():  # the ranks holding the same weights: same tp and pp
        assert len({(grid.coords_of(r).tp, grid.coords_of(r).pp) for r in group}) == 1
    assert grid.cp_groups()[0] == [members[i * tp] for i in range(cp)]


def test_layout_without_cp_has_dp_groups_as_dp_cp_groups():
    grid = RankGrid(Layout(tp=2, dp=2, pp=2), tuple(range(8)))
    assert grid.dp_cp_groups() == grid.dp_groups()
    assert grid.cp_groups() == [[r] for r in range(8)]


def test_cp_sequence_length_must_split_in_2cp_chunks():
    Layout(cp=2).validate(num_layers=2, num_attention_heads=2, seq_length=8)
    with pytest.raises(LayoutError, match="--seq-length .*--context-parallel-size"):
        Layout(cp=2).validate(num_layers=2, num_attention_heads=2, seq_length=6)
    with pytest.raises(LayoutError, match="--sequence-parallel"):
        Layout(cp=2, tp=2, sequence_parallel=True).validate(
            num_layers=2, num_attention_heads=2, seq_length=12
        )
    assert Layout.from_world(8, tp=2, cp=2).dp == 2
