"""The spine's events are dataclasses whose dicts (the log line, W&B, the metrics log, the
operator's answer) keep the keys and order the tools parse (pure; no processes)."""

import dataclasses

from megadyn.core.layout import Layout
from megadyn.elastic.control.events import FailureEvent, format_event, membership_event
from megadyn.elastic.control.records import Reconfiguration


def test_a_membership_change_keeps_the_head_and_a_zero_total():
    dp2, dp1 = Layout(tp=1, pp=1, dp=2), Layout(tp=1, pp=1, dp=1)
    rec = Reconfiguration(epoch=1, event="drain", layout=dp1, members=(0,), release=(2,),
                          old_layout=dp1, old_members=(0,), training={"state": {"iteration": 12}},
                          vocab_size=60)  # fmt: skip
    assert format_event(membership_event(rec)) == (
        " elastic: event: drain | epoch: 1 | iteration: 12 | old: tp1xpp1xdp1 | "
        "new: tp1xpp1xdp1 | left: 2 | total_s: 0.0"
    )
    assert "left" not in membership_event(dataclasses.replace(rec, release=())).to_dict()
    assert membership_event(dataclasses.replace(rec, old_layout=dp2)).old == "tp1xpp1xdp2"


def test_a_failure_event_names_its_source_from_and_keeps_internal_fields_out():
    event = FailureEvent(iteration=5, old="tp1xpp1xdp3", new="tp1xpp1xdp2", left="1", repeated=0,
                         source="replicas", detect_s=0.1, abort_s=0.2, agree_s=0.3, plan_s=0.4,
                         move_s=0.5, rebuild_s=0.6, bytes_moved=0, members=(0, 2),
                         failed_at=1.0)  # fmt: skip
    keys = ["epoch", "event", "iteration", "old", "new", "left", "repeated", "from", "detect_s",
            "abort_s", "agree_s", "plan_s", "move_s", "rebuild_s", "bytes_moved"]  # fmt: skip
    assert list(event.to_dict()) == keys
    done = dataclasses.replace(event, epoch=2, first_step_s=0.7, total_s=2.0, completed=6)
    assert list(done.to_dict()) == keys + ["first_step_s", "total_s", "completed"]
    assert done.to_dict()["from"] == "replicas" and done.to_dict()["epoch"] == 2
