"""torchrun's environment, read in one place.

    env = torchrun_env.current()      # read now (tests change the environment between calls)
    env.restart_count                 # None outside torchrun; 0 on the first attempt

torchrun (torch.distributed.elastic) starts every worker with its rank, world size, local rank,
the agent's store address (MASTER_ADDR/MASTER_PORT), the run id and the attempt number
(`python -m megadyn.launch` adds whether it keeps survivors and whether its store is a
coordinator's). A plain
`python pretrain_gpt.py` has none of them: one process, rank 0. Only the standard library is
imported here: fork_server.py's client reads it before torch is imported.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

COORDINATOR_ENV = "MEGADYN_COORDINATOR"
"""1 in the workers' environment under `python -m megadyn.launch --coordinator`."""
HOST_ENV = "MEGADYN_HOST"
"""Names this process's host in megadyn's records when set (tests simulate several hosts on one
machine, one name per launcher agent); else the host name."""


def host_identity() -> str:
    """This process's host: `MEGADYN_HOST` when set, else the hostname."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    """This worker's global rank (RANK; 0 without torchrun)."""
    world_size: int
    """Workers of this attempt (WORLD_SIZE; 1 without torchrun)."""
    local_rank: int
    """This worker's rank on its host (LOCAL_RANK; 0 without torchrun)."""
    group_rank: str
    """The agent (node rank) this worker belongs to (GROUP_RANK; '' without torchrun)."""
    run_id: str | None
    """torchrun's --rdzv-id (TORCHELASTIC_RUN_ID); None outside torchrun."""
    restart_count: int | None
    """How many times torchrun restarted the worker group (TORCHELASTIC_RESTART_COUNT); None
    outside torchrun."""
    max_restarts: int
    """torchrun's --max-restarts (TORCHELASTIC_MAX_RESTARTS; 0 without it)."""
    master_addr: str | None
    """Host of the agent's store (MASTER_ADDR)."""
    master_port: int | None
    """Port of the agent's store (MASTER_PORT)."""
    use_agent_store: bool
    """The workers' default store is the agent's (TORCHELASTIC_USE_AGENT_STORE)."""
    error_file: str | None
    """Where torchrun's summary reads this worker's error (TORCHELASTIC_ERROR_FILE)."""
    keep_survivors: bool
    """The agent keeps the other workers running when one fails and records the failure in its
    store (MEGADYN_KEEP_SURVIVORS=1, set by `python -m megadyn.launch`: agent.py); False under
    plain torchrun, which stops them all."""
    coordinator: bool
    """The agent's store is `python -m megadyn.launch.coordinator`'s, which may restart: the
    workers reach it through a client that reconnects (MEGADYN_COORDINATOR=1, set by
    `python -m megadyn.launch --coordinator`: store_client.py)."""

    @property
    def under_torchrun(self) -> bool:
        return self.restart_count is not None


def current() -> TorchrunEnv:
    """torchrun's variables as the environment holds them now."""
    env = os.environ
    restart = env.get("TORCHELASTIC_RESTART_COUNT")
    port = env.get("MASTER_PORT")
    return TorchrunEnv(
        rank=int(env.get("RANK", 0)),
        world_size=int(env.get("WORLD_SIZE", 1)),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        group_rank=env.get("GROUP_RANK", ""),
        run_id=env.get("TORCHELASTIC_RUN_ID"),
        restart_count=None if restart is None else int(restart),
        max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0),
        master_addr=env.get("MASTER_ADDR"),
        master_port=None if port is None else int(port),
        use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        error_file=env.get("TORCHELASTIC_ERROR_FILE") or None,
        keep_survivors=env.get("MEGADYN_KEEP_SURVIVORS") == "1",
        coordinator=env.get(COORDINATOR_ENV) == "1",
    )
