"""The leader reads requests from the control store as `Request` records: one that another tool
wrote malformed is refused with the reason, one not yet due waits, and the requests still queued
when the job finishes are refused naming the iteration (one process, no training)."""

from types import SimpleNamespace

from megadyn.elastic.control.channel import NONE, ControlChannel, connect
from megadyn.elastic.control.controller import ElasticController
from megadyn.elastic.control.records import Finish, Request
from megadyn.testing import free_port, spawn


def leader_body(rank, world, port):
    channel = ControlChannel(connect("127.0.0.1", port, is_server=True, timeout_s=30))
    printed = []
    controller = ElasticController(
        SimpleNamespace(elastic=SimpleNamespace(straggler_policy="log")),
        channel,
        "cpu",
        print_fn=lambda *a, **k: printed.append(a[0]),
    )
    trainer = SimpleNamespace(
        iteration=4, groups=SimpleNamespace(grid=SimpleNamespace(members=[0]))
    )
    channel.store.add("request/next", 1)
    channel.store.set("request/0", '{"action": "layout", "tp": "two"}')  # another tool's
    channel.submit(Request(action="scale", members=2, at_iteration=10))
    channel.store.add("request/next", 1)
    channel.store.set("request/2", "{not json")
    decisions = [controller.leader.decide(trainer) for _ in range(2)]
    controller.finish(trainer)
    results = [channel.result(rid, timeout_s=5) for rid in range(3)]
    return decisions, results, printed, channel.epoch(1), channel.handled()


def test_malformed_and_late_requests_are_refused_with_a_reason():
    decisions, results, printed, last, handled = spawn(leader_body, world=1, args=(free_port(),))[0]
    assert decisions == [NONE, NONE] and handled == 3
    assert results[0] == {
        "status": "refused",
        "reason": "tp must be a positive integer, got 'two'",
        "then": "the job goes on unchanged",
    }
    assert "request 0 refused: tp must be a positive integer" in printed[0], printed
    assert results[1] == {
        "status": "refused",
        "reason": "the job finished at iteration 4, before the request's --at-iteration 10",
    }
    assert results[2]["status"] == "refused" and "not JSON" in results[2]["reason"], results
    assert last == Finish(1)
