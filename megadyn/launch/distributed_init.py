"""Start torch.distributed from torchrun's environment (or as a single process without it).

    device = init_distributed(timeout=cfg.parallel.distributed_timeout)

Under torchrun every worker reaches the elastic agent's TCPStore at MASTER_ADDR:MASTER_PORT.
That store outlives the workers, so each restart of the worker group works in a key space of
its own, `attempt_prefix(TORCHELASTIC_RESTART_COUNT)`: the restarted workers never read keys
left by the ones that died (their gloo addresses), and can still read what those left on
purpose (their heartbeats, megadyn/launch/watchdog.py). A replacement host's worker
(MEGADYN_REJOIN, rejoin.py) forms the default group of a later epoch with the survivors.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megadyn.launch import torchrun_env
from megadyn.launch.store_client import ReconnectingStore


def attempt_prefix(restart: int) -> str:
    """The key space of one attempt (the first start is attempt 0) in the agent's store."""
    return f"megadyn/attempt_{restart}/"


def agent_store(timeout: timedelta, wait_s: float | None = None) -> dist.Store:
    """A client of the elastic agent's store (all attempts' keys: wrap it in a PrefixStore).
    When that store is the coordinator's (`--coordinator`), a client that reconnects after the
    coordinator's restart (store_client.py), whose calls wait for it up to `wait_s` seconds
    (default: `timeout`)."""
    env = torchrun_env.current()
    if env.coordinator:
        return ReconnectingStore(env.master_addr, env.master_port, timeout, wait_s)
    return dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timeout)


def init_distributed(timeout: timedelta = timedelta(minutes=10)) -> torch.device:
    """Initialize the default process group (nccl on GPUs, else gloo), its collectives bounded
    by `timeout` (--distributed-timeout-minutes); return this rank's device."""
    env = torchrun_env.current()
    rank, world = env.rank, env.world_size
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        if env.master_addr is None:  # a plain `python pretrain_gpt.py`: one process
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
        restart = env.restart_count
        if os.environ.get("MEGADYN_REJOIN"):  # a replacement host's worker (rejoin.py)
            from megadyn.launch import rejoin  # it imports this module

            rejoin.join_default_group(rejoin.rejoin_epoch(), backend, timeout)
        elif restart is None:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        else:
            store = dist.PrefixStore(attempt_prefix(restart), agent_store(timeout))
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world, timeout=timeout
            )
    return device
