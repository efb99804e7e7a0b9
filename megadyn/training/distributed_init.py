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
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
    return device
