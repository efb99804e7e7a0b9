"""--num-distributed-optimizer-instances without processes: the instance groups, the flag's
checks, the layout kept or dropped to one instance on a change, and the state description
listing each optimizer shard's replicas so that the reshard planner reads a lost rank's shard
from its replica."""

from collections import Counter

import pytest

from megadyn.core.layout import Layout, LayoutError, RankGrid
from megadyn.elastic import DistOpt, PlanError, describe, plan_reshard
from megadyn.elastic.planning.requests import with_job_instances
from megadyn.testing import free_port, run_pretrain, spawn
from megadyn.training.arguments import parse_args
from megadyn.training.config import ConfigError
from tests.elastic.test_live_reconfiguration import ARGS, elastic_run, merged_losses
from tests.elastic.test_planner import GPT2
from tests.training.test_training_run import COMMON


def test_instance_groups_split_each_dp_group_into_runs_of_consecutive_ranks():
    grid = RankGrid(Layout(dp=4, distopt_instances=2), tuple(range(4)))
    assert grid.intra_distopt_groups() == [[0, 1], [2, 3]]
    assert grid.inter_distopt_groups() == [[0, 2], [1, 3]]
    grid = RankGrid(Layout(tp=2, dp=2, pp=2, distopt_instances=2), tuple(range(8)))
    assert grid.intra_distopt_groups() == [[0], [2], [1], [3], [4], [6], [5], [7]]
    assert grid.inter_distopt_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    grid = RankGrid(Layout(dp=2, cp=2, distopt_instances=2), tuple(range(4)))  # cp fastest
    assert grid.intra_distopt_groups() == [[0, 1], [2, 3]]


def test_instances_must_divide_dp_at_start_and_fall_back_to_one_on_a_change():
    with pytest.raises(LayoutError, match="--num-distributed-optimizer-instances.*data-parallel"):
        Layout(dp=3, distopt_instances=2)
    assert Layout(dp=3).with_distopt_instances(2).distopt_instances == 1
    assert Layout(dp=2, cp=3).with_distopt_instances(3).distopt_instances == 3
    flags = COMMON + ["--use-distributed-optimizer", "--num-distributed-optimizer-instances"]
    with pytest.raises(ConfigError, match="^--num-distributed-optimizer-instances .*size \\(3\\)"):
        parse_args(flags + ["2", "--global-batch-size", "6"], 3)
    with pytest.raises(ConfigError, match="needs --use-distributed-optimizer"):
        parse_args(COMMON + ["--num-distributed-optimizer-instances", "2"], 2)
    with pytest.raises(ConfigError, match="^--num-distributed-optimizer-instances"):
        parse_args(flags + ["0"], 2)
    cfg = parse_args(flags + ["2"], 4)
    assert cfg.layout(4).distopt_instances == 2
    assert with_job_instances(Layout(tp=2, dp=2), cfg).distopt_instances == 2  # kept
    assert with_job_instances(Layout(dp=3), cfg).distopt_instances == 1  # dropped


def test_description_lists_each_shard_replica_and_the_planner_reads_a_dead_rank_from_it():
    old = Layout(dp=4, distopt_instances=2)  # instances {0, 1} and {2, 3}
    desc = describe(GPT2, old, range(4), distopt=DistOpt())
    replicas = desc.replicas(1)
    optim = [k for k in replicas if k.startswith("optim.")]
    assert optim and all(replicas[k] == [3] for k in optim)  # rank 1's shard: rank 3 holds it
    assert all(replicas[k] == [0, 2, 3] for k in replicas if k.startswith("model."))
    one = describe(GPT2, Layout(dp=4), range(4), distopt=DistOpt())
    assert all(v == [] for k, v in one.replicas(1).items() if k.startswith("optim."))

    # rank 1 died: the survivors 0 and 2 go on at dp 2 (one instance); rank 2 needs the second
    # half of every bucket, which ranks 1 and 3 held: all of it comes from rank 3
    new, kwargs = Layout(dp=2), dict(old_distopt=DistOpt(), new_distopt=DistOpt())
    plan = plan_reshard(GPT2, old, range(4), new, [0, 2], exclude={1}, **kwargs)
    assert all(t.src != 1 for t in plan.transfers)
    into_2 = [t for t in plan.transfers if t.dst == 2 and t.key.startswith("optim.")]
    assert into_2 and {t.src for t in into_2} == {3}
    unrestricted = plan_reshard(GPT2, old, range(4), new, [0, 2], **kwargs)
    assert {t.src for t in unrestricted.transfers if t.dst == 2} >= {1}  # 1 is a source when alive
    with pytest.raises(PlanError, match=r"optim\..*excluded"):  # one instance: no replica
        plan_reshard(GPT2, Layout(dp=4), range(4), new, [0, 2], exclude={1}, **kwargs)


def test_live_changes_keep_or_drop_the_second_instance_and_train_like_one_process(capfd):
    """dp 4 at 2 instances -> tp 2 x dp 2 (kept) -> pp 2 x dp 1 (one instance, logged) -> dp 4
    (2 again): losses equal an uninterrupted single process's, every sample read once."""
    args = ARGS + ["--train-iters", "8"]
    argv = args + ["--num-distributed-optimizer-instances", "2"]
    reference = spawn(run_pretrain, world=1, args=(args,))[0].history
    port = free_port()
    requests = [
        {"action": "layout", "tp": 2, "pp": 1, "members": 4, "at_iteration": 2},
        {"action": "layout", "tp": 1, "pp": 2, "members": 2, "at_iteration": 4},
        {"action": "layout", "tp": 1, "pp": 1, "members": 4, "at_iteration": 6},
    ]
    argv += ["--elastic-control-port", str(port)]
    results = spawn(elastic_run, world=4, args=(argv, port, requests), timeout_s=180)
    merged_losses(results, reference)
    drawn = Counter(s for r in results for s in r.samples)
    assert sorted(drawn) == list(range(64)) and set(drawn.values()) == {1}
    events = [e["new"] for r in results for e in r.events]
    assert set(events) == {"tp2xpp1xdp2+2opt", "tp1xpp2xdp1", "tp1xpp1xdp4+2opt"}
    out = capfd.readouterr().out
    assert out.count("distributed optimizer: 1 instance under dp=1 cp=1") == 1, out
