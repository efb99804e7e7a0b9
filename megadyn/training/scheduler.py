"""Learning-rate and weight-decay schedules with Megatron's OptimizerParamScheduler semantics.

    sched = LRScheduler.from_config(cfg.scheduler, cfg.optimizer, cfg.training.train_iters,
                                    optimizer=opt)
    for it in range(train_iters):
        ...; opt.step(); sched.step()                  # one step per iteration
    sched.load_state_dict(sched.resume_state(saved, cfg.scheduler))   # resume from a checkpoint

The learning rate rises linearly from `init_lr` to `max_lr` over the warmup steps, then falls to
`min_lr` with the decay style over the decay steps (warmup included) and stays there. Weight
decay moves from `start_wd` to `end_wd` over `wd_incr_steps`. Each optimizer param group gets
`lr * group['lr_mult']` and `wd * group['wd_mult']` (multipliers default to 1); a group may also
carry its own `max_lr` / `min_lr` / `start_wd` / `end_wd`, as in Megatron.

megadyn counts steps in iterations. Megatron counts samples (iterations x global batch); the two
agree whenever the global batch is constant, which is always the case here except during
--rampup-batch-size.

A checkpoint's schedule that differs from the command line's is refused on resume unless
--override-opt_param-scheduler (the command line's goes on) or
--use-checkpoint-opt_param-scheduler (the checkpoint's) says which, as in Megatron.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from megadyn.core.optimizer import OptimizerConfig
from megadyn.training.config import (
    LR_DECAY_STYLES,
    WD_INCR_STYLES,
    WSD_DECAY_STYLES,
    ConfigError,
    SchedulerConfig,
)

_STATE = {  # state_dict key: (attribute, the flag that sets it)
    "max_lr": ("max_lr", "--lr"),
    "min_lr": ("min_lr", "--min-lr"),
    "lr_warmup_init": ("init_lr", "--lr-warmup-init"),
    "lr_warmup_steps": ("warmup_steps", "--lr-warmup-iters"),
    "lr_decay_steps": ("decay_steps", "--lr-decay-iters"),
    "lr_decay_style": ("decay_style", "--lr-decay-style"),
    "lr_wsd_decay_steps": ("wsd_decay_steps", "--lr-wsd-decay-iters"),
    "lr_wsd_decay_style": ("wsd_decay_style", "--lr-wsd-decay-style"),
    "start_wd": ("start_wd", "--start-weight-decay"),
    "end_wd": ("end_wd", "--end-weight-decay"),
    "wd_incr_steps": ("wd_incr_steps", "--train-iters"),
    "wd_incr_style": ("wd_incr_style", "--weight-decay-incr-style"),
}
OVERRIDE_FLAG = "--override-opt_param-scheduler"
USE_CHECKPOINT_FLAG = "--use-checkpoint-opt_param-scheduler"


def check_schedule(sched: SchedulerConfig, opt: OptimizerConfig, train_iters: int) -> None:
    """Raise ConfigError, led by the flag, if these schedule settings cannot run."""
    if not 0.0 <= opt.min_lr <= opt.lr:
        raise ConfigError(f"--min-lr ({opt.min_lr}) must be between 0 and --lr ({opt.lr})")
    if sched.lr_warmup_init > opt.lr:
        raise ConfigError(f"--lr-warmup-init ({sched.lr_warmup_init}) exceeds --lr ({opt.lr})")
    if sched.lr_decay_style not in LR_DECAY_STYLES:
        raise ConfigError(f"--lr-decay-style must be one of {LR_DECAY_STYLES}")
    if sched.lr_warmup_fraction is not None and sched.lr_warmup_iters:
        raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters are exclusive")
    decay = sched.lr_decay_iters or train_iters
    if decay < 1:
        raise ConfigError(f"--lr-decay-iters must be >= 1, got {decay}")
    if sched.warmup_iters(decay) >= decay:
        flag = "--lr-warmup-fraction" if sched.lr_warmup_fraction is not None else ""
        raise ConfigError(
            f"{flag or '--lr-warmup-iters'}: warmup ({sched.warmup_iters(decay)} iterations) "
            f"must be shorter than --lr-decay-iters ({decay})"
        )
    if sched.lr_decay_style == "WSD":
        if sched.lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ConfigError(f"--lr-wsd-decay-style must be one of {WSD_DECAY_STYLES}")
        if sched.lr_wsd_decay_iters is None or not 0 < sched.lr_wsd_decay_iters <= decay:
            raise ConfigError(
                f"--lr-wsd-decay-iters must be in 1..--lr-decay-iters ({decay}) with "
                "--lr-decay-style WSD"
            )
    if sched.weight_decay_incr_style not in WD_INCR_STYLES:
        raise ConfigError(f"--weight-decay-incr-style must be one of {WD_INCR_STYLES}")
    start, end = _weight_decay_range(sched, opt)
    given = sched.start_weight_decay is not None and sched.end_weight_decay is not None
    if sched.weight_decay_incr_style == "constant" and start != end:
        raise ConfigError(
            "--start-weight-decay / --end-weight-decay need a --weight-decay-incr-style "
            "other than constant"
        )
    if sched.weight_decay_incr_style != "constant" and not given:
        raise ConfigError(
            f"--weight-decay-incr-style {sched.weight_decay_incr_style} needs "
            "--start-weight-decay and --end-weight-decay"
        )
    if not 0.0 <= start <= end:
        raise ConfigError(
            f"--start-weight-decay ({start}) must be between 0 and --end-weight-decay ({end})"
        )


def _sources(sched: SchedulerConfig) -> dict[str, str]:
    """The flags that set the values of `_STATE` which another flag defaults."""
    sources = {"lr_decay_steps": "--lr-decay-iters" if sched.lr_decay_iters else "--train-iters"}
    if sched.lr_warmup_fraction is not None:
        sources["lr_warmup_steps"] = "--lr-warmup-fraction"
    for key, given in (("start_wd", sched.start_weight_decay), ("end_wd", sched.end_weight_decay)):
        if given is None:
            sources[key] = "--weight-decay"
    return sources


def _weight_decay_range(sched: SchedulerConfig, opt: OptimizerConfig) -> tuple[float, float]:
    """Start and end weight decay; each defaults to --weight-decay (Megatron's rule)."""
    start, end = sched.start_weight_decay, sched.end_weight_decay
    return (
        opt.weight_decay if start is None else start,
        opt.weight_decay if end is None else end,
    )


class LRScheduler:
    """Sets lr and weight decay at every step on `optimizer` (megadyn's, through set_lr /
    set_weight_decay, or any with torch-style `param_groups`) and/or calls `on_update(lr, wd)`."""

    def __init__(
        self,
        *,
        max_lr: float,
        decay_steps: int,
        min_lr: float = 0.0,
        init_lr: float = 0.0,
        warmup_steps: float = 0,
        decay_style: str = "linear",
        start_wd: float = 0.0,
        end_wd: float = 0.0,
        wd_incr_steps: int = 1,
        wd_incr_style: str = "constant",
        wsd_decay_steps: int | None = None,
        wsd_decay_style: str = "exponential",
        optimizer: Any = None,
        on_update: Callable[[float, float], None] | None = None,
    ) -> None:
        if decay_steps < 1 or warmup_steps >= decay_steps:
            raise ValueError(f"need 0 <= warmup ({warmup_steps}) < decay steps ({decay_steps})")
        if not 0.0 <= min_lr <= max_lr or init_lr > max_lr:
            raise ValueError(f"need 0 <= min_lr ({min_lr}) <= max_lr ({max_lr}) >= init_lr")
        if decay_style == "WSD" and not wsd_decay_steps:
            raise ValueError("the WSD decay style needs wsd_decay_steps")
        self.max_lr, self.min_lr, self.init_lr = float(max_lr), float(min_lr), float(init_lr)
        self.warmup_steps, self.decay_steps, self.decay_style = (
            warmup_steps,
            decay_steps,
            decay_style,
        )
        self.wsd_decay_steps, self.wsd_decay_style = wsd_decay_steps, wsd_decay_style
        self.start_wd, self.end_wd = float(start_wd), float(end_wd)
        self.wd_incr_steps, self.wd_incr_style = max(1, wd_incr_steps), wd_incr_style
        self.num_steps = 0
        # the flag that set each value, for errors (from_config names where defaults came from)
        self.flags = {key: flag for key, (_, flag) in _STATE.items()}
        self.bind(optimizer, on_update)

    @classmethod
    def from_config(
        cls, sched: SchedulerConfig, opt: OptimizerConfig, train_iters: int, **targets: Any
    ) -> LRScheduler:
        """The schedule of the command line, in iterations; `targets`: optimizer=, on_update=."""
        check_schedule(sched, opt, train_iters)
        decay = sched.lr_decay_iters or train_iters
        start, end = _weight_decay_range(sched, opt)
        made = cls(
            max_lr=opt.lr,
            min_lr=opt.min_lr,
            init_lr=sched.lr_warmup_init,
            warmup_steps=sched.warmup_iters(decay),
            decay_steps=decay,
            decay_style=sched.lr_decay_style,
            start_wd=start,
            end_wd=end,
            wd_incr_steps=train_iters,
            wd_incr_style=sched.weight_decay_incr_style,
            wsd_decay_steps=sched.lr_wsd_decay_iters,
            wsd_decay_style=sched.lr_wsd_decay_style,
            **targets,
        )
        made.flags.update(_sources(sched))
        return made

    def lr_at(self, step: float, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """Learning rate after `step` steps (per-group `max_lr`/`min_lr` override the class's)."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * step / self.warmup_steps
        if self.decay_style == "constant":
            return max_lr
        if step > self.decay_steps:
            return min_lr
        if self.decay_style == "inverse-square-root":
            lr = max_lr * math.sqrt(max(self.warmup_steps, 1)) / math.sqrt(max(step, 1))
            return max(min_lr, lr)
        ratio = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        elif self.decay_style == "WSD":
            coeff = self._wsd_coeff(step)
        else:
            raise ValueError(f"unknown lr decay style {self.decay_style!r}")
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self, step: float) -> float:
        anneal_start = self.decay_steps - self.wsd_decay_steps
        if step <= anneal_start:
            return 1.0
        ratio = (step - anneal_start) / self.wsd_decay_steps
        if self.wsd_decay_style == "linear":
            return 1.0 - ratio
        if self.wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.wsd_decay_style == "exponential":
            return 2.0 * 0.5**ratio - 1.0
        if self.wsd_decay_style == "minus_sqrt":
            return 1.0 - math.sqrt(ratio)
        raise ValueError(f"unknown WSD decay style {self.wsd_decay_style!r}")

    def wd_at(
        self, step: float, start_wd: float | None = None, end_wd: float | None = None
    ) -> float:
        """Weight decay after `step` steps."""
        start = self.start_wd if start_wd is None else start_wd
        end = self.end_wd if end_wd is None else end_wd
        if step > self.wd_incr_steps or self.wd_incr_style == "constant":
            return end
        ratio = step / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        elif self.wd_incr_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        else:
            raise ValueError(f"unknown weight decay increment style {self.wd_incr_style!r}")
        return start + coeff * (end - start)

    @property
    def lr(self) -> float:
        """Current base learning rate (what the log line prints)."""
        return self.lr_at(self.num_steps)

    @property
    def wd(self) -> float:
        """Current base weight decay."""
        return self.wd_at(self.num_steps)

    def bind(
        self, optimizer: Any = None, on_update: Callable[[float, float], None] | None = None
    ) -> None:
        """Drive a (new) optimizer and/or callback, e.g. after an elastic rebuild; applies now."""
        self.optimizer, self.on_update = optimizer, on_update
        self._apply()

    def step(self, increment: int = 1) -> None:
        """Advance by `increment` iterations and apply the new values."""
        self.num_steps += increment
        self._apply()

    def _apply(self) -> None:
        if hasattr(self.optimizer, "set_lr"):  # megadyn's MixedPrecisionOptimizer: it applies
            self.optimizer.set_lr(self.lr)  # the groups' wd_mult itself
            self.optimizer.set_weight_decay(self.wd)
        for group in getattr(self.optimizer, "param_groups", ()):
            lr = self.lr_at(self.num_steps, group.get("max_lr"), group.get("min_lr"))
            wd = self.wd_at(self.num_steps, group.get("start_wd"), group.get("end_wd"))
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)
        if self.on_update is not None:
            self.on_update(self.lr, self.wd)

    def state_dict(self) -> dict[str, Any]:
        """Megatron's keys (its steps count samples, megadyn's iterations), with the warmup's
        initial lr and the WSD annealing, which Megatron's do not record."""
        state = {key: getattr(self, attr) for key, (attr, _) in _STATE.items()}
        return {**state, "num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, Any], strict: bool = False) -> None:
        """Go on with the schedule of `state` from its step count: its values replace this
        scheduler's (a rebuild under a new layout goes on with the schedule it had). `strict`:
        refuse a state whose values differ from this scheduler's (ConfigError naming the flag)."""
        if strict:
            self._refuse(self.differences(state))
        for key, value in state.items():
            if key in _STATE:
                setattr(self, _STATE[key][0], value)
        self.num_steps = int(state["num_steps"])
        self._apply()

    def differences(self, state: dict[str, Any]) -> list[tuple[str, Any, Any]]:
        """(key, the state's value, this scheduler's) of each value that differs and matters:
        the increment of a constant weight decay and the annealing of a decay style other than
        WSD are not used."""
        mine = self.state_dict()
        unused = set()
        if state.get("wd_incr_style", "constant") == "constant" == mine["wd_incr_style"]:
            unused.add("wd_incr_steps")
        if "WSD" not in (state.get("lr_decay_style"), mine["lr_decay_style"]):
            unused.update(("lr_wsd_decay_steps", "lr_wsd_decay_style"))
        return [
            (key, state[key], mine[key])
            for key in _STATE
            if key in state and key not in unused and state[key] != mine[key]
        ]

    def resume_state(self, saved: dict[str, Any], cfg: SchedulerConfig) -> dict[str, Any]:
        """The state to go on with from a checkpoint's `saved` one (Megatron's rule): where the
        values differ from this scheduler's (the command line's), --override-opt_param-scheduler
        takes the command line's, --use-checkpoint-opt_param-scheduler the checkpoint's, and
        without either the resume is refused (ConfigError naming the flags and both values)."""
        if cfg.use_checkpoint_opt_param_scheduler:
            return dict(saved)
        if cfg.override_opt_param_scheduler:
            return {**saved, **self.state_dict(), "num_steps": saved["num_steps"]}
        self._refuse(self.differences(saved))
        return dict(saved)

    def _refuse(self, differences: list[tuple[str, Any, Any]]) -> None:
        if not differences:
            return
        said = "; ".join(
            f"{key} {theirs!r} in the checkpoint, {mine!r} on the command line ({self.flags[key]})"
            for key, theirs, mine in differences
        )
        raise ConfigError(
            f"{self.flags[differences[0][0]]}: the checkpoint's learning-rate schedule differs "
            f"from the command line's: {said}. Give {OVERRIDE_FLAG} to go on with the command "
            f"line's values, or {USE_CHECKPOINT_FLAG} to go on with the checkpoint's."
        )
