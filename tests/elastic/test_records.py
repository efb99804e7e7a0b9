"""The control store's records: a request and a reconfiguration survive their JSON, and a
malformed request is refused with a reason naming the field (pure, no processes)."""

import json

import pytest

from megadyn.core.layout import Layout
from megadyn.elastic.control.records import (
    Finish,
    Reconfiguration,
    Request,
    RequestError,
    epoch_record,
)


@pytest.mark.parametrize(
    "request_",
    [
        Request(),
        Request(action="layout", tp=1, pp=2, vpp=2, members=4, at_iteration=6),
        Request(action="layout", tp=2, pp=1, sp=True, dp=2),
        Request(action="scale", members=2, release=True, at_iteration=3),
        Request(action="drain", rank=3),
    ],
)
def test_a_request_survives_its_json(request_):
    assert Request.from_json(request_.to_json()) == request_


@pytest.mark.parametrize(
    "text, reason",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"action": "grow"}', "unknown request action 'grow'"),
        ('{"action": "layout", "tpp": 2}', "unknown request field(s) 'tpp'"),
        ('{"action": "layout", "tp": "2"}', "tp must be a positive integer, got '2'"),
        ('{"action": "layout", "pp": 0}', "pp must be a positive integer, got 0"),
        ('{"action": "layout", "vpp": null}', "vpp must be a positive integer, got None"),
        ('{"action": "layout", "members": true}', "members must be a positive integer"),
        ('{"action": "layout", "sp": 1}', "sp must be true or false, got 1"),
        ('{"action": "layout", "members": 4, "dp": 2}', "members or dp, not both"),
        ('{"action": "scale"}', "a scale request needs members"),
        ('{"action": "scale", "members": 2, "tp": 2}', "a scale request takes no tp"),
        ('{"action": "scale", "members": 2, "at_iteration": -1}', "at_iteration must be"),
        ('{"action": "drain"}', "a drain request, and only a drain request, names a rank"),
        ('{"action": "scale", "members": 2, "rank": 1}', "only a drain request, names a rank"),
        ('{"action": "drain", "rank": -1}', "rank must be an integer >= 0, got -1"),
        ('{"action": "drain", "rank": 1, "members": 2}', "a drain request takes no members"),
        ('{"action": "drain", "rank": 1, "at_iteration": 5}', "takes no at_iteration"),
    ],
)
def test_a_malformed_request_is_refused_naming_the_field(text, reason):
    with pytest.raises(RequestError) as refused:
        Request.from_json(text)
    assert reason in str(refused.value)


def test_defaults_are_those_of_a_request_without_the_field():
    r = Request.from_json('{"members": 2}')
    assert (r.action, r.tp, r.pp, r.vpp, r.sp, r.dp, r.release, r.at_iteration) == (
        "layout", None, None, 1, False, None, False, 0
    )  # fmt: skip


def test_a_reconfiguration_survives_its_json():
    rec = Reconfiguration(
        epoch=3,
        request=7,
        event="scale",
        layout=Layout(tp=2, pp=2, dp=1, vpp=2, sequence_parallel=True),
        members=(0, 1, 2, 3),
        release=(4, 5),
        old_layout=Layout(tp=1, pp=1, dp=6),
        old_members=(0, 1, 2, 3, 4, 5),
        training={"state": {"iteration": 12, "consumed_samples": 96}, "scheduler": {"lr": 1e-3}},
        vocab_size=60,
    )
    text = rec.to_json()
    assert json.loads(text)["layout"]["sequence_parallel"] is True
    assert epoch_record(text) == rec and rec.iteration == 12


def test_the_last_epoch_is_a_finish_record():
    assert json.loads(Finish(5).to_json()) == {"epoch": 5, "event": "finish"}
    assert epoch_record(Finish(5).to_json()) == Finish(5)
