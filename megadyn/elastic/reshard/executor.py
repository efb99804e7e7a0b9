"""The reshard executor: carry out a `Plan` with batched point-to-point transfers.

    plan = plan_reshard(cfg, old_layout, old_members, new_layout, new_members, ...)
    new_state = execute_plan(plan, get_local, group=group, device=device)
    new_state["model.decoder.layers.3.mlp.linear_fc1.weight"]     # this rank's new local tensor

Every process of `group` (old and new members, and any bystander) calls it with the same plan.
`get_local(key)` returns this rank's old local tensor of `key` (its local shape; a flat shard for
distributed-optimizer state); it is only called for keys this rank sends or copies. Local copies
(src == dst) need no communication. The remote transfers are packed into rounds in which no rank
sends plus receives more than `round_bytes` (larger transfers are cut), and in each round the
transfers between two ranks of one dtype travel as one message, so extra memory stays bounded by
the round size beyond the new state itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megadyn.elastic.reshard.plan import Plan, Transfer
from megadyn.elastic.reshard.regions import split_lengths

DEFAULT_ROUND_BYTES = 256 * 2**20


def split_transfer(t: Transfer, max_bytes: int) -> list[Transfer]:
    """`t` cut into transfers of at most `max_bytes` (at least one element each)."""
    if t.nbytes <= max_bytes:
        return [t]
    itemsize = t.nbytes // t.src_region.numel
    out = []
    for rel in split_lengths(t.src_region.lengths, max(1, max_bytes // itemsize)):
        src, dst = t.src_region.sub(rel), t.dst_region.sub(rel)
        out.append(Transfer(t.src, t.dst, t.key, src, dst, src.numel * itemsize))
    return out


def schedule_rounds(transfers: list[Transfer], round_bytes: int) -> list[list[Transfer]]:
    """Remote transfers in rounds where each rank sends plus receives at most `round_bytes`.

    A pure function of the plan: every rank computes the same rounds (first fit, in plan order).
    """
    rounds: list[list[Transfer]] = []
    used: list[dict[int, int]] = []
    full: dict[int, int] = {}  # rank -> rounds before this one have no room left for it
    for whole in transfers:
        if whole.src == whole.dst:
            continue
        for t in split_transfer(whole, round_bytes):
            i = max(full.get(t.src, 0), full.get(t.dst, 0))
            while True:
                if i == len(rounds):
                    rounds.append([])
                    used.append({})
                u = used[i]
                load = max(u.get(t.src, 0), u.get(t.dst, 0))
                if load + t.nbytes <= round_bytes or not load:  # (one element may be larger)
                    break
                i += 1
            rounds[i].append(t)
            for r in (t.src, t.dst):
                u[r] = u.get(r, 0) + t.nbytes
                while (
                    full.get(r, 0) < len(rounds) and used[full.get(r, 0)].get(r, 0) >= round_bytes
                ):
                    full[r] = full.get(r, 0) + 1
    return rounds


def _dtype_tag(dtype: torch.dtype) -> int:
    return sum(str(dtype).encode()) % 1024


def execute_plan(
    plan: Plan,
    get_local: Callable[[str], torch.Tensor],
    *,
    group=None,
    device: torch.device | str = "cpu",
    round_bytes: int = DEFAULT_ROUND_BYTES,
) -> dict[str, torch.Tensor]:
    """Run this rank's part of `plan`; return {key: new local tensor} for its new pieces."""
    rank = dist.get_rank()
    old_held = plan.old.held(rank)
    new_held = plan.new.held(rank)
    out = {
        key: torch.empty(p.local_shape, dtype=plan.new.tensors[key].dtype, device=device)
        for key, p in new_held.items()
    }
    flat_out = {key: t.view(-1) for key, t in out.items()}
    sources: dict[str, torch.Tensor] = {}

    def source(key: str) -> torch.Tensor:
        if key not in sources:
            tensor = get_local(key).detach().reshape(-1)
            if tensor.numel() != old_held[key].numel:
                raise ValueError(
                    f"get_local({key!r}) on rank {rank} has {tensor.numel()} elements; the old "
                    f"layout's piece has {old_held[key].numel}"
                )
            sources[key] = tensor
        return sources[key]

    for t in plan.transfers:
        if t.src == rank and t.dst == rank:
            t.dst_region.of(flat_out[t.key]).copy_(t.src_region.of(source(t.key)))

    # every rank of the group takes part in a first collective (NCCL's first batched p2p)
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    for round_ in schedule_rounds(plan.transfers, round_bytes):
        _run_round([t for t in round_ if rank in (t.src, t.dst)], rank, source, flat_out, group)
    return out


def _run_round(transfers, rank, source, flat_out, group) -> None:
    """One round: one message per (peer, direction, dtype), all posted in one batch."""
    if not transfers:
        return
    messages: dict[tuple, list[tuple[torch.Tensor, Transfer]]] = {}
    for t in transfers:
        sending = t.src == rank
        view = t.src_region.of(source(t.key)) if sending else t.dst_region.of(flat_out[t.key])
        peer = t.dst if sending else t.src
        messages.setdefault((peer, sending, str(view.dtype)), []).append((view, t))
    ops, unpack = [], []
    for (peer, sending, _), parts in sorted(messages.items(), key=lambda kv: kv[0]):
        views = [v for v, _ in parts]
        tag = _dtype_tag(views[0].dtype)
        if len(views) == 1 and views[0].is_contiguous():
            buf = views[0]
        elif sending:
            buf = torch.cat([v.reshape(-1) for v in views])
        else:
            buf = torch.empty(
                sum(v.numel() for v in views), dtype=views[0].dtype, device=views[0].device
            )
            unpack.append((buf, views))
        op = dist.isend if sending else dist.irecv
        ops.append(dist.P2POp(op, buf, peer, group, tag))
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    for buf, views in unpack:
        offset = 0
        for v in views:
            v.copy_(buf[offset : offset + v.numel()].view(v.shape))
            offset += v.numel()
