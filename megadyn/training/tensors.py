"""A layout's training tensors by global key, as the live reshard moves them.

    tensors = export_tensors(chunks, optimizer, cfg.optimizer)   # before the change
    adopt_tensors(chunks, optimizer, received)                   # after `Trainer.build`

Keys follow the layout-free state description (megadyn/elastic/description): `model.<name>`
for a weight, `optim.<name>.<main|exp_avg|exp_avg_sq>` for the fp32 main weight and Adam
moments of the range this rank updates (a flat shard under the distributed optimizer, the
whole parameter's shape otherwise).
"""

from __future__ import annotations

import torch

from megadyn.core.optimizer import OptimizerConfig
from megadyn.core.optimizer.shards import STATE_KEYS


def export_tensors(chunks, optimizer, cfg: OptimizerConfig) -> dict[str, torch.Tensor]:
    """This rank's weights and optimizer state (views, not copies) by global key; the
    parameters must be gathered first (`Trainer.params_ready`)."""
    out = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            out[f"model.{name}"] = param.detach()
            for key, value in optimizer.shard_state(param).items():
                shaped = value if cfg.use_distributed_optimizer else value.view(param.shape)
                out[f"optim.{name}.{key}"] = shaped
    return out


@torch.no_grad()
def adopt_tensors(chunks, optimizer, state: dict[str, torch.Tensor]) -> None:
    """Copy received weights into `chunks` and optimizer state into `optimizer`."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            param.copy_(state[f"model.{name}"].view(param.shape))
            start, end = optimizer.shard_range(param)
            if end > start:
                shard = {k: state[f"optim.{name}.{k}"].reshape(-1) for k in STATE_KEYS}
                optimizer.load_shard_state(param, shard)
