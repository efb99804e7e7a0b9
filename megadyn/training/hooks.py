"""What the job around training runs beside the trainer's loop.

    trainer = Trainer(cfg, groups, device, hooks=[snapshots, watchdog.step_hook])

A hook is a `StepHook` or a plain callable (`hook(trainer)`, run at every step boundary). The
trainer runs them in the order given at each step boundary (after the log line, evaluation,
checkpoint and --exit-interval of the step), before the groups change (`quiesce`), when it is
built for new groups and after its last step. megadyn/launch composes them (snapshots,
heartbeats, the elastic controller); this package never imports the runtime.
"""

from __future__ import annotations

from collections.abc import Callable


class StepHook:
    """Something run beside the training loop; each method does nothing unless overridden."""

    def after_step(self, trainer) -> None:
        """At a step boundary (may raise to leave the loop or rebuild the trainer)."""

    def quiesce(self, trainer) -> None:
        """The groups are about to change: finish what still uses them."""

    def new_layout(self, trainer) -> None:
        """The trainer is (re)built for new groups: drop what belonged to the old ones."""

    def abandon(self, trainer) -> None:
        """A peer died: forget what uses the old groups, without waiting on anyone."""

    def end(self, trainer) -> None:
        """The last step is done (the parameters are gathered, checkpoints may still write)."""


class CallableHook(StepHook):
    """A plain `fn(trainer)` run at every step boundary."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def after_step(self, trainer) -> None:
        self.fn(trainer)


def as_hooks(hooks) -> list[StepHook]:
    """`hooks` (StepHooks or callables, None for none) as StepHooks."""
    return [h if isinstance(h, StepHook) else CallableHook(h) for h in hooks or ()]
