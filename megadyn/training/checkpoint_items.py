"""This rank's training state as DCP items under global names, from the state description.

    model.<name>                   weight, model dtype, global shape (its split view)
    optim.<name>.main|exp_avg|exp_avg_sq   fp32, same pieces as the weight
    rng.pp<p>.tp<t>.<stream>       RNG states (only restored under the same tp and pp)

A split weight becomes a ShardedTensor whose metadata lists the pieces of every rank of this
rank's tp group (a partition of the global tensor) with only this rank's piece local; a
replicated weight is a plain tensor. DCP writes identical pieces once.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from megadyn.core.tensor_parallel import group_rank, group_size
from megadyn.models.sharding import Piece, param_specs, tp_piece

OPTIM_KEYS = ("main", "exp_avg", "exp_avg_sq")

# ShardedTensor is how DCP takes pieces that are not torch.chunk slices (vocab, SwiGLU rows).
warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*")


def _placement(rank: int, device: torch.device) -> str:
    return f"rank:{rank}/{device.type}" + (f":{device.index}" if device.index is not None else "")


def sharded(local: torch.Tensor, pieces: list[Piece], mine: int, ranks: list[int]) -> ShardedTensor:
    """`local` (this rank's piece `pieces[mine]`) as part of the global tensor the pieces tile."""
    shards = [
        ShardMetadata(list(p.offsets), list(p.sizes), _placement(r, local.device))
        for p, r in zip(pieces, ranks)
    ]
    meta = ShardedTensorMetadata(
        shards_metadata=shards,
        size=torch.Size(pieces[mine].view_shape),
        tensor_properties=TensorProperties(dtype=local.dtype, pin_memory=local.is_pinned()),
    )
    view = local.reshape(pieces[mine].sizes)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(view, shards[mine])], meta
    )


def local_value(item) -> torch.Tensor:
    if isinstance(item, ShardedTensor):
        return item.local_shards()[0].tensor
    return item


def _item(tensor: torch.Tensor, spec, cfg, groups):
    tp, rank = group_size(groups.tp_group), group_rank(groups.tp_group)
    if spec.split_dim is None and not spec.vocab:
        return tensor.reshape(spec.view or spec.shape)
    pieces = [tp_piece(spec, cfg, tp, r) for r in range(tp)]
    return sharded(tensor, pieces, rank, list(groups.tp_ranks))


def _copy(t: torch.Tensor, key: str, device, staging: dict | None) -> torch.Tensor:
    """`t` copied to `device`; into a reused (pinned, on GPUs) buffer of `staging` when given,
    without waiting for the copy (the caller synchronizes before reading the buffers)."""
    if staging is None:
        return t.to(device, copy=True)
    buf = staging.get(key)
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        buf = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=t.is_cuda)
        staging[key] = buf
    return buf.copy_(t, non_blocking=True)


def local_items(
    chunks, groups, optimizer=None, *, empty: bool = False, device=None, staging=None
) -> dict:
    """{key: tensor or ShardedTensor} of this rank's weights (and optimizer state); with
    `device`, copies on that device (host staging for asynchronous saves; `staging` keeps the
    host buffers from one save to the next)."""
    items = {}
    for chunk in chunks:
        specs = param_specs(chunk.cfg)
        for name, param in chunk.named_parameters():
            spec = specs[name]
            value = torch.empty_like(param) if empty else param.detach()
            key = f"model.{name}"
            value = value if device is None else _copy(value, key, device, staging)
            items[key] = _item(value, spec, chunk.cfg, groups)
            if optimizer is None:
                continue
            state = None if empty else optimizer.param_state(param)
            for key in OPTIM_KEYS:
                t = (
                    torch.empty(param.shape, dtype=torch.float32, device=param.device)
                    if empty
                    else state[key]  # a copy already
                )
                item = f"optim.{name}.{key}"
                t = t if device is None else _copy(t, item, device, staging)
                items[item] = _item(t, spec, chunk.cfg, groups)
    return items


def check_shapes(path: str, items: dict, stored: dict) -> None:
    """Raise naming the tensor when the checkpoint lacks it or holds another global shape."""
    for key, item in items.items():
        if key not in stored:
            raise ValueError(
                f"--load {path}: checkpoint has no tensor {key!r} (a different model?)"
            )
        want = tuple(item.size()) if isinstance(item, ShardedTensor) else tuple(item.shape)
        have = tuple(getattr(stored[key], "size", ()))
        if want != have:
            raise ValueError(
                f"--load {path}: {key} has global shape {have} in the checkpoint but {want} in this "
                "model (check --num-layers, --hidden-size, --num-attention-heads, --vocab-size)"
            )


def rng_streams(chunks) -> dict[str, torch.Tensor]:
    """This rank's RNG streams: the default generator's (and CUDA's), and the tensor-parallel
    tracker's named streams (`tracker.<name>`)."""
    tracker = next((c.tracker for c in chunks if c.tracker is not None), None)
    device = next(chunks[0].parameters()).device
    states = {"default": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    if tracker is not None:
        states.update({f"tracker.{k}": v for k, v in tracker.get_states().items()})
    return states


def set_rng_streams(chunks, states: dict[str, torch.Tensor]) -> None:
    """Put the streams `rng_streams` gave back (those present in `states`)."""
    device = next(chunks[0].parameters()).device
    tracker = next((c.tracker for c in chunks if c.tracker is not None), None)
    if "default" in states:
        torch.set_rng_state(states["default"])
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)
    named = {k[len("tracker.") :]: v for k, v in states.items() if k.startswith("tracker.")}
    if tracker is not None and named:
        tracker.set_states(named)


def _prefix(groups) -> str:
    return f"rng.pp{groups.pp_rank}.tp{groups.tp_rank}."


def rng_items(groups, chunks, *, empty: bool = False) -> dict:
    """The RNG streams as checkpoint items, under this rank's (pp, tp) coordinates."""
    streams = rng_streams(chunks)
    return {_prefix(groups) + k: (torch.empty_like(v) if empty else v) for k, v in streams.items()}


def set_rng_items(groups, chunks, items: dict) -> None:
    prefix = _prefix(groups)
    set_rng_streams(chunks, {k[len(prefix) :]: v for k, v in items.items() if k.startswith(prefix)})
