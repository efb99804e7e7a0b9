"""Pretrain a GPT model with megadyn: `torchrun --nproc-per-node N pretrain_gpt.py <Megatron flags>`.

    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --num-layers 24 --hidden-size 2048 ... --mock-data
    torchrun --nproc-per-node 4 pretrain_gpt.py --default-job      # the README's main job

The job itself is megadyn/launch/run.py's `main`.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # a restarted worker may run in a child of the host's fork server
    from megadyn.launch import fork_server, startup

    fork_server.hand_over(sys.argv[1:], startup.process_start_time())

from megadyn.launch import errors
from megadyn.launch.run import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(errors.run_reported(main))  # one message per failure; MEGADYN_DEBUG=1 for tracebacks
