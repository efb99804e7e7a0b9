"""Bodies for `spawn`: run pretrain_gpt.py's main in each spawned process."""

from __future__ import annotations


def run_pretrain(rank: int, world: int, argv) -> object:
    """`pretrain_gpt.main(argv)` on this rank (torch.distributed is already initialized)."""
    import pretrain_gpt

    return pretrain_gpt.main(list(argv))
