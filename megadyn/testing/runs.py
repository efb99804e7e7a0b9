"""Bodies for `spawn`: run a job's main (megadyn/launch/run.py) in each spawned process."""

from __future__ import annotations


def run_pretrain(rank: int, world: int, argv):
    """`pretrain_gpt.py`'s job (`megadyn.launch.run.main(argv)`) on this rank
    (torch.distributed is already initialized): its RunResult (megadyn/launch/result.py)."""
    from megadyn.launch.run import main

    return main(list(argv))
