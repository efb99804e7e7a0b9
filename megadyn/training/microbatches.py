"""How many micro batches make one optimizer step: Megatron's micro-batch calculator, made pure.

Megatron keeps a module-level calculator object that is updated as samples are consumed. Here
the global batch size is a function of the consumed samples only, and the number of micro batches a
function of (consumed samples, dp size), so the elastic controller can change dp between two
steps and ask again:

    mb = MicroBatchCalculator(micro_batch_size=2, final_global_batch_size=64,
                              rampup=(16, 16, 3000))          # --rampup-batch-size 16 16 3000
    mb.global_batch_size(consumed_samples=0)                  # 16
    mb.num_micro_batches(consumed_samples=0, dp_size=4)       # 16 // (2 * 4) = 2
    mb.num_micro_batches(consumed_samples=10_000, dp_size=2)  # 64 // (2 * 2) = 16

Ramp-up (Megatron's rule): the batch grows from `start` by `increment` in
(final - start) / increment equal slices of `ramp-up samples`; after them it stays at the final
size.
"""

from __future__ import annotations

from dataclasses import dataclass

from megadyn.training.config import ConfigError, TrainingConfig


@dataclass(frozen=True)
class MicroBatchCalculator:
    micro_batch_size: int
    """Samples per micro batch on one data-parallel rank (--micro-batch-size)."""
    final_global_batch_size: int
    """Global batch size after ramp-up, or always without it (--global-batch-size)."""
    rampup: tuple[int, int, int] | None = None
    """(start batch size, increment, ramp-up samples) (--rampup-batch-size)."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ConfigError(f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        if self.final_global_batch_size < 1:
            raise ConfigError(
                f"--global-batch-size must be >= 1, got {self.final_global_batch_size}"
            )
        if self.rampup is None:
            return
        if len(self.rampup) != 3:
            raise ConfigError(
                "--rampup-batch-size expects <start batch size> <increment> <ramp-up samples>"
            )
        start, increment, samples = self.rampup
        if start < 1 or increment < 1 or samples < 0:
            raise ConfigError(
                f"--rampup-batch-size: start and increment must be >= 1 and ramp-up samples "
                f">= 0, got {list(self.rampup)}"
            )
        diff = self.final_global_batch_size - start
        if diff < 0 or diff % increment:
            raise ConfigError(
                f"--rampup-batch-size: --global-batch-size ({self.final_global_batch_size}) minus "
                f"the start batch size ({start}) must be a non-negative multiple of the "
                f"increment ({increment})"
            )

    @classmethod
    def from_config(cls, training: TrainingConfig) -> MicroBatchCalculator:
        return cls(
            training.micro_batch_size, training.global_batch_size, training.rampup_batch_size
        )

    def global_batch_size(self, consumed_samples: int) -> int:
        """Global batch size of the step that starts after `consumed_samples` samples."""
        if self.rampup is None:
            return self.final_global_batch_size
        start, increment, samples = self.rampup
        steps = (self.final_global_batch_size - start) // increment
        if steps == 0 or consumed_samples > samples:
            return self.final_global_batch_size
        samples_per_step = samples / steps
        return start + int(consumed_samples / samples_per_step) * increment

    def num_micro_batches(self, consumed_samples: int, dp_size: int) -> int:
        """Micro batches each data-parallel rank runs in the step after `consumed_samples`."""
        batch = self.global_batch_size(consumed_samples)
        self._check_divisible(batch, dp_size)
        return batch // (self.micro_batch_size * dp_size)

    def batch_sizes(self) -> list[int]:
        """Every global batch size the run goes through, in order."""
        if self.rampup is None:
            return [self.final_global_batch_size]
        start, increment, _ = self.rampup
        return list(range(start, self.final_global_batch_size + 1, increment))

    def check_dp_size(self, dp_size: int) -> None:
        """Raise ConfigError now if any batch size of the run will not split over `dp_size`."""
        for batch in self.batch_sizes():
            self._check_divisible(batch, dp_size)

    def _check_divisible(self, batch: int, dp_size: int) -> None:
        if batch % (self.micro_batch_size * dp_size) == 0:
            return
        final = batch == self.final_global_batch_size
        raise ConfigError(
            f"{'--global-batch-size' if final else '--rampup-batch-size'}: global batch size "
            f"{batch} is not divisible by --micro-batch-size ({self.micro_batch_size}) x "
            f"data-parallel size ({dp_size})"
        )

    def train_iterations(self, train_samples: int) -> int:
        """Optimizer steps that consume `train_samples` samples (Megatron's update_train_iters)."""
        if self.rampup is None:
            return train_samples // self.final_global_batch_size
        iterations, consumed = 0, 0
        while consumed <= self.rampup[2] and consumed <= train_samples:
            consumed += self.global_batch_size(consumed)
            iterations += 1
        return iterations + max(0, train_samples - consumed) // self.final_global_batch_size
