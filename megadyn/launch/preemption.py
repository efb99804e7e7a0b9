"""SIGTERM as a preemption notice: recorded by a handler, acted on at the next step boundary.

    if preemption.install(cfg):          # run.py, before training
        ...
    preemption.received()                # True once SIGTERM came
    preemption.end()                     # the notice cannot be honoured: end as SIGTERM does

What SIGTERM does to a worker:

    elastic mode, --elastic-recovery in-process (default)   the process is drained: a live
        scale-in at the next step boundary, and it exits 0 (megadyn/elastic/control/drain.py)
    --exit-signal-handler (Megatron-LM's flag), a drain refused or no elastic mode   every
        member saves a checkpoint (with --save) at the next step boundary and exits 0
    otherwise                                            the default action: the process ends

The handler only sets a flag (a second SIGTERM takes the default action at once). Python runs
it between bytecodes of the main thread, so a process inside a long collective notices at its
end, and the step boundary acts on it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from megadyn.elastic.control.drain import Stopped
from megadyn.training.hooks import StepHook

_received = False
"""Set by the SIGTERM handler; the one piece of module state (a handler has nowhere else)."""


def _on_sigterm(signum, frame) -> None:
    global _received
    if _received:  # a second notice: no more grace
        end()
    _received = True


def install(cfg) -> bool:
    """Take over SIGTERM when the job acts on it (see the module docstring); False when SIGTERM
    keeps its default action (or this is not the main thread, where no handler can be set)."""
    el = cfg.elastic
    drains = el.live and el.recovery == "in-process"
    if not (drains or el.exit_signal_handler):
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True


def received() -> bool:
    """SIGTERM came since `install`."""
    return _received


def end() -> None:
    """End this process as SIGTERM's default action does."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    while True:  # delivered to some thread of this process; it ends them all
        time.sleep(1)


class ExitSignalHook(StepHook):
    """--exit-signal-handler without elastic mode (Megatron-LM's): at every step boundary the
    processes agree whether any got SIGTERM (one all-reduce of a host flag over the layout's
    gloo members group, so the device's queue of work is not waited for); then all stop, and
    the runtime saves a checkpoint (with --save) and exits 0."""

    def __init__(self, *, saves: bool, print_fn=print) -> None:
        self.saves, self.print = saves, print_fn

    def after_step(self, trainer) -> None:
        group = trainer.groups.members_group
        flag = torch.tensor([float(_received)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not flag.item():
            return
        it = trainer.iteration
        if dist.get_rank(group) == 0:
            save = "saving a checkpoint and " if self.saves else ""
            self.print(
                f" exit signal handler: SIGTERM received; {save}exiting at iteration {it} "
                "(--exit-signal-handler)",
                flush=True,
            )
        raise Stopped(f"SIGTERM at iteration {it}")
