"""Stragglers: per-rank step parts scored against the median, named under --log-straggler, and
excluded live under --elastic-straggler-policy exclude.

Three spawned jobs of 4 processes at dp 4 (MEGADYN_TEST_SLOW_RANK=2:0.05 makes rank 2 sleep
before each forward):

    unslowed, log       no rank is named a straggler; its losses are the reference below
    rank 2 slowed, log  rank 2 is named within 3 log intervals, the layout stays
    rank 2 slowed,      rank 2 leaves the layout (dp 4 -> dp 3) and waits as a standby
      exclude           process; every loss equals the unslowed run's; the control store's
                        state (tools/elastic_ctl.py show) holds the scores

The CPU's noise (4 processes on the test machine's few cores) puts unslowed ranks up to about
2x the median in a log interval, so these jobs use --straggler-threshold 3.
"""

import re
import threading
import time

import pytest
import test_live_reconfiguration as live

from megadyn.elastic.stragglers import RankFigures, StragglerDetector, format_scores
from megadyn.testing import free_port, run_pretrain, spawn
from megadyn.training.arguments import ConfigError, parse_args

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 --make-vocab-size-divisible-by 8 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 60 --micro-batch-size 1 --global-batch-size 12 "
    "--lr 1e-3 --lr-decay-style constant --hidden-dropout 0 --attention-dropout 0 --seed 7 "
    "--eval-interval 0 --num-workers 0 --use-distributed-optimizer --train-iters 12 "
    "--log-interval 2 --log-straggler --straggler-threshold 3 --straggler-intervals 3"
).split()
SLOW = "2:0.05"
LINE = re.compile(r" straggler: slowest rank (\d+) \(\S+, cpu\) \| score ([\d.]+) x median")
NAMED = re.compile(r"rank (\d+) is a straggler")
ITERATION = re.compile(r" iteration +(\d+)/")


def figures(rank: int, compute_s: float, grads_s: float) -> RankFigures:
    return RankFigures(rank, "host", "cpu", compute_s, 0.001, grads_s, 0.002, 0.1)


def test_the_slow_rank_scores_high_and_the_ranks_that_wait_for_it_do_not():
    detector = StragglerDetector(threshold=1.15, intervals=3)
    # rank 2 computes 0.2 s; the others compute 0.1 s and wait 0.1 s in the gradient reduction
    interval = [figures(r, 0.2 if r == 2 else 0.1, 0.0 if r == 2 else 0.1) for r in range(4)]
    verdicts = [detector.observe(i, interval) for i in (2, 4, 6)]
    assert [v.straggler for v in verdicts] == [None, None, 2]
    assert verdicts[-1].scores == (1.0, 1.0, 2.0, 1.0)
    assert verdicts[-1].streaks == (0, 0, 3, 0)
    assert "slowest rank 2 (host, cpu) | score 2.00 x median" in format_scores(verdicts[-1], 3)
    # an interval where rank 2 keeps up ends its streak
    even = [figures(r, 0.1, 0.0) for r in range(4)]
    assert detector.observe(8, even).straggler is None
    assert detector.observe(10, interval).streaks[2] == 1
    detector.reset()
    assert detector.observe(12, interval).streaks == (0, 0, 1, 0)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--elastic-straggler-policy", "rebalance"], "--elastic-straggler-policy rebalance"),
        (["--elastic-straggler-policy", "exclude"], "--elastic-straggler-policy exclude"),
        (["--straggler-threshold", "0.9"], "--straggler-threshold"),
        (["--straggler-intervals", "0"], "--straggler-intervals"),
    ],
)
def test_straggler_flags_that_cannot_run_are_refused_naming_the_flag(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args(TINY + flags, world_size=4)


def named_at(log: str) -> dict[int, int]:
    """The iteration at which each rank was first named a straggler."""
    named, iteration = {}, 0
    for line in log.splitlines():
        if m := ITERATION.search(line):
            iteration = int(m.group(1))
        if m := NAMED.search(line):
            named.setdefault(int(m.group(1)), iteration)
    return named


def test_log_names_the_slowed_rank_and_no_rank_when_none_is_slow(capfd, monkeypatch):
    reference = spawn(run_pretrain, world=4, args=(TINY,))[3]
    log = capfd.readouterr().out
    assert len(LINE.findall(log)) == 6, log  # one line per log interval
    assert named_at(log) == {}, log

    monkeypatch.setenv("MEGADYN_TEST_SLOW_RANK", SLOW)
    slowed = spawn(run_pretrain, world=4, args=(TINY,))[3]
    log = capfd.readouterr().out
    print(log)
    assert named_at(log) == {2: 6}, log  # the third interval (iterations 5-6)
    assert {rank for rank, _ in LINE.findall(log)} == {"2"}, log
    assert "elastic:" not in log  # log only: the layout stays
    assert len(slowed) == len(reference) == 12


def excluding_run(rank, world, argv, port):
    """pretrain_gpt.py on every rank; rank 0 also reads the state the leader publishes (what
    tools/elastic_ctl.py show prints) until it holds a straggler."""
    import pretrain_gpt

    seen = {}
    if rank == 0:
        threading.Thread(target=watch_state, args=(port, seen), daemon=True).start()
    result = pretrain_gpt.main(list(argv))
    return dict(result, state=seen.get("state"))


def watch_state(port: int, seen: dict) -> None:
    from megadyn.elastic.control import ControlChannel, connect

    channel = ControlChannel(connect("127.0.0.1", port, is_server=False))
    while "state" not in seen:
        try:
            state = channel.state() or {}
        except RuntimeError:  # the job ended
            return
        if state.get("stragglers", {}).get("straggler") is not None:
            seen["state"] = state
        time.sleep(0.01)


def test_exclude_moves_to_the_layout_without_the_straggler(capfd, monkeypatch):
    reference = spawn(run_pretrain, world=4, args=(TINY,))[3]
    capfd.readouterr()
    monkeypatch.setenv("MEGADYN_TEST_SLOW_RANK", SLOW)
    port = free_port()
    argv = TINY + ["--elastic-control-port", str(port), "--elastic-layout", "pinned",
                   "--elastic-straggler-policy", "exclude"]  # fmt: skip
    results = spawn(excluding_run, world=4, args=(argv, port), timeout_s=120)
    log = capfd.readouterr().out
    print(log)
    live.merged_losses(results, reference)
    events = [e for r in results for e in r["events"]]
    assert {(e["event"], e["old"], e["new"]) for e in events} == {
        ("straggler", "tp1xpp1xdp4", "tp1xpp1xdp3")
    }, events
    excluded = re.search(r" elastic: straggler: excluded \| epoch: 1 \| iteration: (\d+) .*", log)
    assert excluded, log
    assert int(excluded.group(1)) <= 6, log  # named within 3 intervals, excluded at once
    fields = dict(f.split(": ", 1) for f in excluded.group(0).split(" | ")[1:])
    assert fields["rank"] == "2" and fields["new"] == "tp1xpp1xdp3", fields
    assert float(fields["after_step_s"]) < float(fields["before_step_s"]), fields
    state = results[0]["state"]
    assert state["stragglers"]["straggler"] == 2, state
    scores = {r["rank"]: r["score"] for r in state["stragglers"]["ranks"]}
    assert sorted(scores) == [0, 1, 2, 3] and max(scores, key=scores.get) == 2, scores
