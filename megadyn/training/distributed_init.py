"""Start torch.distributed from torchrun's environment (or as a single process without it)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed(timeout_s: float = 600.0) -> torch.device:
    """Initialize the default process group (nccl on GPUs, else gloo); return this rank's device."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # a plain `python pretrain_gpt.py`: one process
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
        timeout = timedelta(seconds=timeout_s)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is None:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        else:  # under torchrun: a key space of our own per restart, so that no key left by
            # workers that died (their gloo addresses) is read by the restarted ones
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=timeout,
            )
            store = dist.PrefixStore(f"megadyn/attempt_{restart}/", store)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world, timeout=timeout
            )
    return device
