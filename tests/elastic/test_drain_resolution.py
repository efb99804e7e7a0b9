"""A drain notice, resolved (pure, one control store, no training): a standby process takes the
drained member's place; else the layout for the remaining members (pinned or planned); rank 0,
a rank below --elastic-min-members and --elastic-recovery restart are refused, and the refusal
either stops the job (--exit-signal-handler) or ends the drained process as SIGTERM would.
tools/elastic_ctl.py sends the same notice; SIGTERM is taken over only where the job acts on it
(--elastic-recovery, --exit-signal-handler)."""

import dataclasses
import importlib.util
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megadyn.core.layout import Layout, LayoutError
from megadyn.elastic.control.channel import NONE, ControlChannel, connect
from megadyn.elastic.control.drain import Drain, DrainSignal
from megadyn.elastic.control.records import Request
from megadyn.elastic.planning.requests import resolve_drain
from megadyn.launch import preemption
from megadyn.testing import free_port
from megadyn.training.arguments import parse_args
from tests.tiny import tiny_args

TINY = tiny_args(num_layers=4, global_batch_size=12, train_iters=10)


def config(*flags: str, world: int = 4):
    return parse_args(TINY + list(flags), world_size=world)


def groups(layout: Layout, members):
    return SimpleNamespace(
        layout=layout, grid=SimpleNamespace(members=tuple(members)), backend="gloo"
    )


def drain(rank: int, cfg, layout: Layout, members, live):
    return resolve_drain(rank, cfg.model, cfg, groups(layout, members), list(live))


def test_a_standby_process_takes_the_drained_members_place():
    dp3 = Layout(tp=1, pp=1, dp=3)
    layout, members, release = drain(1, config(), dp3, (0, 1, 2), range(5))
    assert (layout, members, release) == (dp3, [0, 2, 3], [1])


def test_a_drained_standby_process_only_leaves_the_live_set():
    dp3 = Layout(tp=1, pp=1, dp=3)
    assert drain(4, config(), dp3, (0, 1, 2), range(5)) == (dp3, [0, 1, 2], [4])


def test_without_standby_the_rest_go_on_under_the_layout_for_their_count():
    tp2dp2 = Layout(tp=2, pp=1, dp=2)
    layout, members, release = drain(2, config(), tp2dp2, (0, 1, 2, 3), range(4))  # auto
    assert layout.world_size == 3 and sorted(members) == [0, 1, 3] and release == [2]
    pinned = config("--elastic-layout", "pinned", world=3)
    dp3 = Layout(tp=1, pp=1, dp=3)
    assert drain(1, pinned, dp3, (0, 1, 2), range(3)) == (Layout(tp=1, pp=1, dp=2), [0, 2], [1])
    with pytest.raises(LayoutError):  # pinned: tp 2 does not divide 3 processes
        drain(2, config("--elastic-layout", "pinned"), tp2dp2, (0, 1, 2, 3), range(4))


@pytest.mark.parametrize(
    "rank, flags, live, reason",
    [
        (0, (), range(3), "rank 0 hosts the control store"),
        (
            2,
            ("--elastic-min-members", "3"),
            range(3),
            "2 members is below --elastic-min-members (3)",
        ),
        (5, (), range(3), "rank 5 is not a live process of the job"),
    ],
)
def test_a_drain_that_cannot_run_is_refused_with_the_reason(rank, flags, live, reason):
    with pytest.raises(LayoutError) as refused:
        drain(rank, config(*flags, world=3), Layout(tp=1, pp=1, dp=3), (0, 1, 2), live)
    assert reason in str(refused.value)


@pytest.mark.parametrize("exit_signal_handler", [False, True])
def test_a_refused_drain_stops_the_job_or_ends_the_drained_process(exit_signal_handler):
    channel = ControlChannel(connect("127.0.0.1", free_port(), is_server=True, timeout_s=10))
    cfg = config("--elastic-recovery", "restart", world=3)
    cfg = dataclasses.replace(
        cfg, elastic=dataclasses.replace(cfg.elastic, exit_signal_handler=exit_signal_handler)
    )
    ended, printed = [], []
    drained = Drain(channel, DrainSignal(received=lambda: True, end=lambda: ended.append(1)))
    drained.send(2)  # rank 2 got SIGTERM
    drained.send(2)  # one notice, however many step boundaries follow
    leader = Drain(channel)
    trainer = SimpleNamespace(iteration=7)
    decision = leader.decide(trainer, cfg, None, 1, lambda line, **_: printed.append(line))
    assert leader.decide(trainer, cfg, None, 1, print) is None  # the queue is empty again
    drained.fall_back_if_refused()
    assert "drain of rank 2 refused: --elastic-recovery restart" in printed[0], printed
    if exit_signal_handler:
        assert decision == {"stop": "drain of rank 2 refused: --elastic-recovery restart"}
        assert "every member" not in printed[0] and "the job exits at iteration 7" in printed[0]
    else:
        assert decision == NONE and "SIGTERM ends rank 2 (no --exit-signal-handler)" in printed[0]
    assert ended == [1]  # the drained side reads the refusal (it acts on it only after "none")


def test_a_refused_drain_the_operator_asked_for_changes_nothing():
    # tools/elastic_ctl.py drain 2 under --exit-signal-handler: refused, no stop, and rank 2
    # (which got no SIGTERM) goes on
    channel = ControlChannel(connect("127.0.0.1", free_port(), is_server=True, timeout_s=10))
    cfg = config("--elastic-recovery", "restart", "--exit-signal-handler", world=3)
    rid = channel.submit(Request(action="drain", rank=2, by_operator=True))
    printed = []
    decision = Drain(channel).decide(
        SimpleNamespace(iteration=7), cfg, None, 1, lambda line, **_: printed.append(line)
    )
    assert decision == NONE, decision
    assert channel.answered(rid, "drain") == {
        "status": "refused",
        "reason": "--elastic-recovery restart",
        "then": "the job goes on unchanged",
    }
    assert printed[0].endswith("refused: --elastic-recovery restart; the job goes on unchanged")


def test_a_standby_process_with_its_own_notice_queued_takes_no_place():
    # rank 1 (a member) and standby rank 3 got SIGTERM at once: standby 4 replaces rank 1
    channel = ControlChannel(connect("127.0.0.1", free_port(), is_server=True, timeout_s=10))
    cfg, dp3 = config("--elastic-initial-members", "3", world=5), Layout(tp=1, pp=1, dp=3)
    for rank in (1, 3):
        Drain(channel, DrainSignal(received=lambda: True)).send(rank)
    trainer = SimpleNamespace(
        iteration=7,
        groups=groups(dp3, (0, 1, 2)),
        model_cfg=SimpleNamespace(vocab_size=60),
        training_state_dict=lambda: {"state": {"iteration": 7}},
    )

    def resolve(rank, leaving):
        live = [r for r in range(5) if r == rank or r not in leaving]
        return resolve_drain(rank, cfg.model, cfg, trainer.groups, live)

    assert Drain(channel).decide(trainer, cfg, resolve, 1, print) == {"epoch": 1}
    rec = channel.epoch(1)
    assert (rec.event, rec.members, rec.release) == ("drain", (0, 2, 4), (1,))
    assert channel.answered(0, "drain") == {"status": "accepted", "epoch": 1}


def test_the_operator_tool_sends_a_drain_notice_the_leader_reads():
    path = Path(__file__).resolve().parents[2] / "tools" / "elastic_ctl.py"
    spec = importlib.util.spec_from_file_location("elastic_ctl", path)
    elastic_ctl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(elastic_ctl)
    port = free_port()
    channel = ControlChannel(connect("127.0.0.1", port, is_server=True, timeout_s=10))
    codes = []
    tool = threading.Thread(
        target=lambda: codes.append(
            elastic_ctl.main(["--port", str(port), "--timeout", "20", "drain", "2"])
        )
    )
    tool.start()
    leader = Drain(channel)
    while (pending := leader.pending()) is None:
        time.sleep(0.01)
    rid, notice = pending
    assert notice.action == "drain" and notice.rank == 2
    channel.answer(rid, {"status": "accepted", "epoch": 1}, "drain")
    tool.join(timeout=20)
    assert codes == [0]


@pytest.mark.parametrize(
    "flags, taken",
    [
        ((), False),  # no elastic mode: SIGTERM's default action
        (("--exit-signal-handler",), True),
        (("--elastic-control-port", "29999"), True),  # elastic mode: in-process by default
        (("--elastic-control-port", "29999", "--elastic-recovery", "restart"), False),
        (
            (
                "--elastic-control-port",
                "29999",
                "--elastic-recovery",
                "restart",
                "--exit-signal-handler",
            ),
            True,
        ),
    ],
)
def test_sigterm_is_taken_over_only_where_the_job_acts_on_it(flags, taken):
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert preemption.install(config(*flags)) is taken
        assert (signal.getsignal(signal.SIGTERM) is not before) is taken
    finally:
        signal.signal(signal.SIGTERM, before)
