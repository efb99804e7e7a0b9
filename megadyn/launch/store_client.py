"""A client of the coordinator's store that outlives the coordinator: it connects again when a
coordinator comes back at the same address.

    store = ReconnectingStore("coord", 29400, timedelta(seconds=60))            # waits for it
    beats = ReconnectingStore("coord", 29400, timeout, wait_s=0)                # fails fast
    beats.on_reconnect.append(lambda: beats.set("heartbeat/0", now()))        # publish anew

torch's TCPStore client does not reconnect: once its server stops, every call raises. Under
`python -m megadyn.launch --coordinator` (coordinator.py) every agent and worker reaches the
job's store through this class instead. A call that finds the coordinator gone drops the
client; the next calls look for a server at the same address (a plain TCP connect, at most
every `RETRY_S` seconds, so an outage costs no log line per call) and, once one answers, make a
new client and run `on_reconnect` before the call itself: the coordinator came back with an
empty store, and each owner publishes there again what it keeps in it (keep-alives, heartbeats,
failure records, the rendezvous state). While the coordinator is down a call waits for it up to
`wait_s` seconds (default: the store's timeout; 0 for the loops that must go on without it),
then raises `CoordinatorDown`.

It overrides every method of `dist.Store`, and each instance stays referenced for the life of
the process (`c10d_compat.keep_python_store` says why).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from megadyn.core import c10d_compat

RETRY_S = 0.5
"""How often a store whose coordinator is gone looks for it again."""
CONNECT_S = 5.0
"""How long the new client may take to connect once the address answers."""


def probe(address: tuple[str, int], timeout_s: float) -> None:
    """Open and close a plain TCP connection to `address` (OSError if nothing answers within
    `timeout_s`): a check that costs no store client's error log."""
    socket.create_connection(address, timeout=timeout_s).close()


class CoordinatorDown(dist.DistNetworkError):
    """The coordinator did not answer within the call's wait."""


class ReconnectingStore(dist.Store):
    """A TCPStore client of `host`:`port` that makes a new client when the server comes back
    (module docstring)."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout: timedelta,
        wait_s: float | None = None,
        client: dist.Store | None = None,
    ):
        """`client`: an open client of that address (default: connect now, waiting up to
        `timeout` for the server, as a TCPStore client does)."""
        super().__init__()
        super().set_timeout(timeout)
        self.host, self.port = host, port
        self.wait_s = timeout.total_seconds() if wait_s is None else wait_s
        self.on_reconnect: list[Callable[[], None]] = []
        """Run after each new client is made, before the call that made it."""
        self.reconnects = 0
        """How many times a new client was made after the coordinator went away."""
        self.down_since: float | None = None
        """Monotonic time of the call that found the coordinator gone (None: connected)."""
        self._client = client if client is not None else self._tcp_client(timeout)
        self._next_try = 0.0
        self._lock = threading.Lock()
        c10d_compat.keep_python_store(self)

    def _tcp_client(self, timeout: timedelta) -> dist.TCPStore:
        client = dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout)
        client.set_timeout(self.timeout)
        return client

    def _call(self, op: str, *args):
        return self._run(op, lambda client: getattr(client, op)(*args))

    def _run(self, op: str, call: Callable[[dist.Store], object]):
        """`call(client)`, on a new client if the coordinator went away meanwhile."""
        deadline = time.monotonic() + self.wait_s
        while True:
            client = self._client or self._reconnect()
            if client is not None:
                try:
                    return call(client)
                except dist.DistNetworkError:
                    self._lose(client)
            left = deadline - time.monotonic()
            if left <= 0:
                raise CoordinatorDown(
                    f"the coordinator {self.host}:{self.port} does not answer ({op})"
                )
            time.sleep(min(RETRY_S, left))

    def _lose(self, client) -> None:
        with self._lock:
            if self._client is client:
                self._client = None
                self.down_since = time.monotonic()

    def _reconnect(self) -> dist.Store | None:
        """A new client if the coordinator answers again (None while it does not); the first
        thread to make one runs `on_reconnect`."""
        with self._lock:
            if self._client is not None:  # another thread connected meanwhile
                return self._client
            if time.monotonic() < self._next_try:
                return None
            self._next_try = time.monotonic() + RETRY_S
            try:  # a plain connect first: torch's client logs every failed attempt
                probe((self.host, self.port), RETRY_S)
                self._client = self._tcp_client(timedelta(seconds=CONNECT_S))
            except (OSError, dist.DistError):
                return None
            self.reconnects += 1
            self.down_since = None
        for publish in self.on_reconnect:
            publish()
        return self._client

    def _confirmed(self, op: str, keys: list[str], *args) -> None:
        """A write, then a read of its keys: a client whose server died takes one write without
        an error (nothing answers a write), so the read finds the loss and the write is made
        again on a new client."""
        self._run(op, lambda client: (getattr(client, op)(*args), client.check(keys)))

    # --- every method of dist.Store ----------------------------------------------------------
    def set(self, key: str, value) -> None:
        self._confirmed("set", [key], key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def append(self, key: str, value) -> None:
        self._confirmed("append", [key], key, value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call("wait", keys, *([] if timeout is None else [timeout]))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", keys)

    def multi_set(self, keys: list[str], values: list) -> None:
        self._confirmed("multi_set", keys, keys, values)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    def has_extended_api(self) -> bool:
        return True  # TCPStore's

    def queue_push(self, key: str, value) -> None:
        self._confirmed("queue_push", [], key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self._call("queue_pop", key, block)

    def queue_len(self, key: str) -> int:
        return self._call("queue_len", key)

    def list_keys(self) -> list[str]:
        return self._call("list_keys")

    def barrier(self) -> None:
        self._call("barrier")

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        client = self._client
        if client is not None:
            client.set_timeout(timeout)

    def clone(self) -> ReconnectingStore:
        return ReconnectingStore(self.host, self.port, self.timeout, self.wait_s)
