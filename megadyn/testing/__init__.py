"""Helpers for megadyn's own tests: spawning gloo process groups on free ports."""

from megadyn.testing.runs import run_pretrain
from megadyn.testing.spawn import free_port, spawn

__all__ = ["free_port", "run_pretrain", "spawn"]
