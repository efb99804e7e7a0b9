"""The job's control channel: a c10d TCPStore that operators and the job's processes share.

Rank 0 of the job hosts the store on `--elastic-control-port`; `tools/elastic_ctl.py` and every
process of the job connect to it as clients. Keys:

    request/next            id of the next request to write (a counter)
    request/<id>            JSON of an operator request (control/records.py `Request`)
    request/handled         requests the leaders handled so far
    request/taken           id of the request whose reconfiguration runs (until answered: after
                            a failure cuts it short, the leader puts it back in the queue)
    drain/next, drain/<id>, drain/handled, drain/result/<id>
                            the same for drain notices (a process got SIGTERM: control/drain.py), a
                            queue of their own so that none waits behind an operator request
                            whose --at-iteration is still ahead
    decision/<iteration>    the leader's decision for the step boundary after <iteration>:
                            JSON {"epoch": n} or "none"
    epoch/<n>               JSON of reconfiguration n (control/records.py `Reconfiguration`, or `Finish`
                            at the end; standby processes wait on the next epoch's key)
    rng/<n>/pp<p>/tp<t>     RNG streams handed over in reconfiguration n (recovery/rng_handover.py)
    result/<id>             JSON: {"status": "done"|"refused", "reason": ..., "then": ...,
                            "layout": ...} ("then": what the job does after a refusal)
    state                   JSON the job publishes for `elastic_ctl.py show`

Only the leader (the first member of the current layout) reads requests; every other process
follows its decisions, so all processes change layout at the same step boundary.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch.distributed as dist

from megadyn.elastic.control.records import Finish, Reconfiguration, Request, epoch_record

NONE = "none"
UNCHANGED = "the job goes on unchanged"
"""What the job does after refusing an operator's request (the answer's "then")."""
TAKEN_KEY = "request/taken"


class StoreGone(RuntimeError):
    """The control store stopped answering: the process hosting it exited or failed."""


def connect(
    host: str,
    port: int,
    *,
    is_server: bool,
    world_size: int | None = None,
    timeout_s: float = 300.0,
    launcher_port: int | None = None,
    connect_timeout_s: float | None = None,
) -> dist.TCPStore:
    """The control store: the server on rank 0, clients elsewhere (and in the operator tool).
    A client tries to reach the server for `connect_timeout_s` (default `timeout_s`), and
    then waits up to `timeout_s` for a key: after a recovery re-hosts the store, a server
    that died again is given up on in the recovery's time, not the store's.

    The server refuses `launcher_port`, the port of torchrun's own store when the workers use
    it (megadyn/launch/run.py passes it): there torch's TCPStore, finding the port taken,
    would go on as a client of torchrun's store, whose keys outlive an attempt, so a restarted
    job would read the decisions of the attempt before it. Any other port it cannot bind
    raises."""
    if is_server and port == launcher_port:
        raise RuntimeError(
            f"--elastic-control-port {port} is torchrun's store port (MASTER_PORT): "
            "pick another port for the control store"
        )
    first = timeout_s if connect_timeout_s is None else connect_timeout_s
    store = dist.TCPStore(
        host, port, world_size, is_server, timedelta(seconds=first), wait_for_workers=False
    )
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def _get_json(store, key: str):
    return json.loads(store.get(key).decode())


def _set_json(store, key: str, value) -> None:
    store.set(key, json.dumps(value))


class ControlChannel:
    """Reads and writes of the control keys, for the leader, the followers and the operator."""

    def __init__(self, store):
        self.store = store

    # --- operator side -----------------------------------------------------------------------
    def submit(self, request: Request | dict) -> int:
        """Queue an operator request (a dict is read as `Request.from_dict`, which raises
        RequestError before anything is queued); returns its id."""
        if not isinstance(request, Request):
            request = Request.from_dict(request)
        queue = queue_of(request)
        rid = self.store.add(f"{queue}/next", 1) - 1
        self.store.set(f"{queue}/{rid}", request.to_json())
        return rid

    def result(self, rid: int, timeout_s: float, queue: str = "request") -> dict | None:
        """The answer to request `rid`, None when none came within `timeout_s`; StoreGone
        when the store closed meanwhile (its host ended: the answer will not come)."""
        try:
            self.store.wait([_result_key(queue, rid)], timedelta(seconds=timeout_s))
        except dist.DistNetworkError as e:
            raise StoreGone(str(e)) from None
        except dist.DistError:  # the wait timed out: no answer yet
            return None
        return _get_json(self.store, _result_key(queue, rid))

    def answered(self, rid: int, queue: str = "request") -> dict | None:
        """The answer to request `rid` if there is one yet (does not wait)."""
        if not self.store.check([_result_key(queue, rid)]):
            return None
        return _get_json(self.store, _result_key(queue, rid))

    def state(self) -> dict | None:
        if not self.store.check(["state"]):
            return None
        return _get_json(self.store, "state")

    # --- leader side -------------------------------------------------------------------------
    def handled(self, queue: str = "request") -> int:
        """Requests handled so far (kept in the store, so a new leader goes on from there)."""
        return int(self.store.add(f"{queue}/handled", 0))

    def mark_handled(self, rid: int, queue: str = "request") -> None:
        self.store.add(f"{queue}/handled", 1)

    def mark_taken(self, rid: int) -> None:
        """Request `rid` (handled) is being applied: its reconfiguration was published."""
        self.store.set(TAKEN_KEY, str(rid))

    def requeue_cut_short(self) -> int | None:
        """After a recovery: the request whose reconfiguration a failure cut short (taken,
        never answered, the last one handled) is put back at the head of the queue; its id,
        or None when there is none."""
        if not self.store.check([TAKEN_KEY]):
            return None
        rid = int(self.store.get(TAKEN_KEY))
        self.store.delete_key(TAKEN_KEY)
        if self.store.check([_result_key("request", rid)]) or self.handled() != rid + 1:
            return None
        self.store.add("request/handled", -1)
        return rid

    def pending_request(self, handled: int, queue: str = "request") -> tuple[int, str] | None:
        """The oldest request with id >= `handled` that was fully written, if any, as its id
        and its JSON (the leader decodes it: `Request.from_json`)."""
        if not self.store.check([f"{queue}/{handled}"]):
            return None
        return handled, self.store.get(f"{queue}/{handled}").decode()

    def decide(self, iteration: int, decision) -> None:
        _set_json(self.store, f"decision/{iteration}", decision)

    def publish_epoch(self, record: Reconfiguration | Finish) -> None:
        self.store.set(f"epoch/{record.epoch}", record.to_json())

    def answer(self, rid: int, result: dict, queue: str = "request") -> None:
        _set_json(self.store, _result_key(queue, rid), result)

    def publish_state(self, state: dict) -> None:
        _set_json(self.store, "state", state)

    # --- follower side -----------------------------------------------------------------------
    def decision(self, iteration: int, interrupt=None):
        """Block until the leader decided for `iteration`; `interrupt()` runs while it waits
        (it raises to stop waiting: a peer died, recovery/recovery.py)."""
        key = f"decision/{iteration}"
        if interrupt is not None:
            delay = 0.0005
            while not self.store.check([key]):
                interrupt()
                time.sleep(delay)
                delay = min(0.01, delay * 2)
        return _get_json(self.store, key)

    def epoch(self, n: int) -> Reconfiguration | Finish:
        """Reconfiguration `n` (published before the decision that names it)."""
        return epoch_record(self.store.get(f"epoch/{n}").decode())

    def wait_epoch(self, n: int, poll_s: float = 0.01, on_poll=None) -> Reconfiguration | Finish:
        """Block, for as long as it takes, until reconfiguration `n` is published (polled: a
        store wait that times out prints a warning each time, and a standby process may wait
        for hours); `on_poll()` runs at each poll (a standby process sends its drain notice)."""
        key = f"epoch/{n}"
        while not self.store.check([key]):
            if on_poll is not None:
                on_poll()
            time.sleep(poll_s)
        return self.epoch(n)


DRAIN_QUEUE = "drain"
"""The control store's queue of drain notices (megadyn/elastic/control/drain.py)."""


def queue_of(request: Request) -> str:
    """The queue a request goes into: "drain" for drain notices, else "request"."""
    return DRAIN_QUEUE if request.action == "drain" else "request"


def _result_key(queue: str, rid: int) -> str:
    return f"result/{rid}" if queue == "request" else f"{queue}/result/{rid}"
