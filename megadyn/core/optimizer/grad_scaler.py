"""Loss scalers for fp16 training: a constant one and Megatron's dynamic one.

The trainer multiplies the loss by `scaler.scale` before backward; the optimizer divides the
gradients by it, and on overflow (inf / nan anywhere) skips the step and lets the scaler react.
"""

from __future__ import annotations

import torch


class ConstantGradScaler:
    """A fixed loss scale (--loss-scale)."""

    def __init__(self, scale: float):
        self.scale = torch.tensor(float(scale), dtype=torch.float32)

    @property
    def inv_scale(self) -> torch.Tensor:
        return self.scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": float(self.scale)}

    def load_state_dict(self, state: dict) -> None:
        self.scale = torch.tensor(float(state["scale"]), dtype=torch.float32)


class DynamicGradScaler(ConstantGradScaler):
    """Halve the scale after `hysteresis` overflowing steps; double it after `growth_interval`
    steps in a row without overflow (Megatron's rule)."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_interval: int,
        hysteresis: int,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ):
        super().__init__(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                new = max(float(self.scale) * self.backoff_factor, self.min_scale)
                self.scale = torch.tensor(new, dtype=torch.float32)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": float(self.scale),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
