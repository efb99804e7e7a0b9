"""Mixed-precision Adam(W) with loss scaling, global-norm clipping and ZeRO-1 sharding.

`build_optimizer(chunks, ddp_wrappers, groups, OptimizerConfig(...))` is the entry point.
"""

from megadyn.core.optimizer.config import OptimizerConfig
from megadyn.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megadyn.core.optimizer.optimizer import (
    MixedPrecisionOptimizer,
    OptimizerStep,
    StepInterrupted,
    build_optimizer,
)
from megadyn.core.optimizer.shards import ParamShard, uses_weight_decay

__all__ = [
    "ConstantGradScaler",
    "DynamicGradScaler",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "OptimizerStep",
    "ParamShard",
    "StepInterrupted",
    "build_optimizer",
    "uses_weight_decay",
]
