"""torchrun's c10d rendezvous in the coordinator's store, surviving the coordinator's restart:
the rendezvous backend `--coordinator HOST:PORT` selects (`--rdzv-backend megadyn`).

    rendezvous.register()       # before torchrun's launcher builds its rendezvous handler

It is torchrun's own: its DynamicRendezvousHandler over its C10dRendezvousBackend, in a
`ReconnectingStore` (store_client.py) instead of a TCPStore client. What this backend adds
happens only while the coordinator is down or just back:
- down: reads and writes of the rendezvous state find no store after one `RETRY_S` wait and
  answer "no state" instead of raising. torchrun's handler then sees an empty rendezvous: its
  keep-alive has nothing to refresh, `num_nodes_waiting` is 0, so neither the agent's monitor
  loop nor the keep-alive thread fails or logs per retry; the agent logs one line;
- back (an empty store): the state as this agent last read it is published again, its nodes'
  keep-alive times set to now (c10d_compat.rendezvous_state_refreshed: an outage longer than
  torchrun's keep-alive limit would otherwise drop every node), unless another agent published
  it first; the agent logs one line. A rendezvous started later (torchrun's restart path) runs
  in the same store as before.
"""

from __future__ import annotations

from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    create_handler,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.elastic.utils.logging import get_logger

from megadyn.core import c10d_compat
from megadyn.launch.store_client import RETRY_S, CoordinatorDown, ReconnectingStore

BACKEND = "megadyn"
"""The name torchrun's --rdzv-backend knows this backend by."""
logger = get_logger(__name__)


def register() -> None:
    """Make `--rdzv-backend megadyn` known to torchrun (again: a no-op)."""
    rendezvous_handler_registry.register(BACKEND, create_rdzv_handler)


def create_rdzv_handler(params: RendezvousParameters):
    """torchrun's handler for `params` (--rdzv-endpoint is the coordinator), over two clients
    of its store: one that waits for the coordinator (the agents' store: ranks, exit barrier)
    and one that does not (the rendezvous state: read every monitor interval)."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    store = ReconnectingStore(host, port, timeout)
    backend = CoordinatorBackend(ReconnectingStore(host, port, timeout, wait_s=RETRY_S), params)
    return create_handler(store, backend, params)


class CoordinatorBackend(RendezvousBackend):
    """torchrun's C10dRendezvousBackend that answers "no state" while the coordinator is down
    and publishes the last state it saw when the coordinator comes back (module docstring)."""

    def __init__(self, store: ReconnectingStore, params: RendezvousParameters):
        self.store, self.run_id = store, params.run_id
        self.where = params.endpoint
        self._inner = C10dRendezvousBackend(store, self.run_id)
        self._last: bytes | None = None  # the state as the store held it when last read
        self._down = False
        store.on_reconnect.append(self._publish_again)

    @property
    def name(self) -> str:
        return BACKEND

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            found = self._inner.get_state()
        except RendezvousConnectionError as e:
            return self._unanswered(e)
        self._last = None if found is None else found[0]
        return found

    def set_state(self, state: bytes, token: Token | None = None):
        try:
            found = self._inner.set_state(state, token)
        except RendezvousConnectionError as e:
            return self._unanswered(e)
        self._last = None if found is None else found[0]
        return found

    def _unanswered(self, e: RendezvousConnectionError) -> None:
        if not isinstance(e.__cause__, CoordinatorDown):
            raise e
        if not self._down:
            self._down = True
            logger.warning(
                "megadyn.launch: the coordinator %s does not answer: the workers keep training, "
                "failures wait for it to come back at the same address",
                self.where,
            )
        return None

    def _publish_again(self) -> None:
        """The coordinator is back with an empty store: the sentinel key of torchrun's backend,
        then the last state this agent saw (the first agent to publish wins)."""
        self._inner = C10dRendezvousBackend(self.store, self.run_id)
        if self._last is not None:
            self._inner.set_state(c10d_compat.rendezvous_state_refreshed(self._last))
        self._down = False
        logger.warning(
            "megadyn.launch: the coordinator %s is back: what this agent keeps in its store "
            "(the rendezvous, keep-alives, failure records) is published again",
            self.where,
        )
