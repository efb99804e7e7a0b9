"""Configuration of the optimizer (Adam(W) with mixed precision, loss scaling and clipping).

The argument parser translates Megatron's flags (`--lr`, `--weight-decay`, `--clip-grad`,
`--bf16`, `--use-distributed-optimizer`, ...) into this dataclass; nothing else reads flags.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OptimizerConfig:
    """Adam(W) hyper-parameters and the mixed-precision / ZeRO-1 switches."""

    lr: float = 1e-4
    """Initial (peak) learning rate (--lr); the scheduler drives it through `set_lr`."""
    min_lr: float = 0.0
    """Learning rate at the end of decay (--min-lr); used by the scheduler, kept here for it."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay of matrices (--weight-decay); biases and 1-D params get 0."""
    adam_beta1: float = 0.9
    """Adam first-moment decay (--adam-beta1)."""
    adam_beta2: float = 0.999
    """Adam second-moment decay (--adam-beta2)."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon (--adam-eps)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (--clip-grad); 0 disables clipping."""
    bf16: bool = False
    """Model params are bf16 (--bf16); the optimizer keeps fp32 main params (or remainders)."""
    fp16: bool = False
    """Model params are fp16 (--fp16); fp32 main params and dynamic loss scaling."""
    loss_scale: float | None = None
    """Static loss scale for fp16 (--loss-scale); None means dynamic scaling."""
    initial_loss_scale: float = 2.0**32
    """Starting dynamic loss scale (--initial-loss-scale)."""
    min_loss_scale: float = 1.0
    """The dynamic loss scale never drops below this (--min-loss-scale)."""
    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic loss scale doubles (--loss-scale-window)."""
    hysteresis: int = 2
    """Overflowing steps tolerated before the dynamic loss scale halves (--hysteresis)."""
    use_distributed_optimizer: bool = False
    """ZeRO-1 (--use-distributed-optimizer): shard main params and Adam state over dp."""
    use_precision_aware_optimizer: bool = False
    """Keep no fp32 main copy of bf16 params (--use-precision-aware-optimizer): a 16-bit
    remainder beside the bf16 weight gives back the fp32 main value exactly (2 bytes a
    parameter shard instead of 4). Needs --bf16."""
    log_num_zeros_in_grad: bool = False
    """Count zero gradient entries at each step (--log-num-zeros-in-grad)."""

    def __post_init__(self) -> None:
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 are mutually exclusive")
        if self.use_precision_aware_optimizer and not self.bf16:
            raise ValueError(
                "--use-precision-aware-optimizer needs --bf16: its remainders complete bf16 "
                "weights to fp32"
            )
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0, got {self.clip_grad}")
