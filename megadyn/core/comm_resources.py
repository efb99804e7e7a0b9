"""What one layout's overlapped tensor-parallel communication keeps between calls.

--tp-comm-overlap's copy-engine transport (tensor_parallel/sp_overlap.py) needs a side stream
per device and a symmetric-memory workspace per group, with every rank's buffer view of it per
shape; an eager step makes some 1,500 all-gathers, so these are kept between calls. They belong to the layout
whose groups carry the transfers: `ParallelGroups` owns one `CommResources` (`groups.comm`) and
its `destroy()` releases it, so a dead layout keeps no workspace, stream or buffer.

    overlap = groups.comm_overlap("copy-engine")   # CommOverlap(transport, groups.comm)
    layer = ColumnParallelLinear(..., groups.tp_group, comm_overlap=overlap)
    ...
    groups.destroy()                               # releases groups.comm

Layers built with a transport name instead (`comm_overlap="copy-engine"`) find the resources
of their group through `CommResources.of(group)`: while a `ParallelGroups` lives it registers
its tensor-parallel group here, and `release()` removes the entry, so that table holds live
layouts only. The NCCL transport needs none of this.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from megadyn.core import c10d_compat

# group name -> the resources of the live layout that created the group (see the docstring)
_serving: weakref.WeakValueDictionary[str, CommResources] = weakref.WeakValueDictionary()


def _symmetric_workspace(group, nbytes: int, device: torch.device):
    """A symmetric-memory workspace of `nbytes` over `group` (collective: every rank of the
    group calls it): (its memory, the handle whose `get_buffer` views every rank's memory).
    The caller owns both; dropping them frees the memory."""
    symm_mem = c10d_compat.symmetric_memory()
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"a {nbytes}-byte symmetric-memory workspace cannot be allocated during CUDA graph "
            "capture: run an eager step of the same shapes before capturing"
        )
    tensor = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    return tensor, symm_mem.rendezvous(tensor, group.group_name)


@dataclass
class _Workspace:
    """One group's workspace: its memory, the handle, its size and the buffer views per shape."""

    tensor: object
    handle: object
    nbytes: int
    buffers: dict


class CommResources:
    """Side streams and symmetric-memory workspaces of one layout's groups; `release()` frees
    them. `allocate(group, nbytes, device) -> (tensor, handle)` makes a workspace (tests pass a
    stand-in: symmetric memory needs CUDA)."""

    def __init__(self, allocate: Callable = _symmetric_workspace):
        self._allocate = allocate
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._workspaces: dict[str, _Workspace] = {}  # group name -> workspace
        self._served: list[str] = []

    @staticmethod
    def of(group) -> CommResources:
        """The resources of the live layout whose `ParallelGroups` created `group`."""
        resources = _serving.get(group.group_name)
        if resources is None:
            raise RuntimeError(
                f"process group {group.group_name} belongs to no live ParallelGroups: build the "
                "layers with comm_overlap=groups.comm_overlap(transport)"
            )
        return resources

    def serve(self, group) -> None:
        """Make these the resources `CommResources.of(group)` finds, until `release()`."""
        _serving[group.group_name] = self
        self._served.append(group.group_name)

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream of `device` on which the copy-engine transfers run."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def workspace_buffers(self, x: torch.Tensor, group):
        """(handle, every rank's workspace buffer shaped like x) of `group`'s workspace, grown
        (collectively, with its buffers made anew) when x does not fit."""
        nbytes = x.numel() * x.element_size()
        ws = self._workspaces.get(group.group_name)
        if ws is None or nbytes > ws.nbytes:  # a larger workspace replaces the old one
            self._workspaces.pop(group.group_name, None)  # the old memory goes first
            tensor, handle = self._allocate(group, nbytes, x.device)
            ws = self._workspaces[group.group_name] = _Workspace(tensor, handle, nbytes, {})
        key = (tuple(x.shape), x.dtype)
        if key not in ws.buffers:
            ws.buffers[key] = [
                ws.handle.get_buffer(r, x.shape, x.dtype) for r in range(ws.handle.world_size)
            ]
        return ws.handle, ws.buffers[key]

    @property
    def empty(self) -> bool:
        """Whether nothing is held (no stream, no workspace, no group served)."""
        return not (self._streams or self._workspaces or self._served)

    def release(self) -> None:
        """Wait for the side streams' work, then drop every stream, workspace and buffer and
        stop serving the groups; the object may be used again afterwards (it starts empty)."""
        for stream in self._streams.values():
            stream.synchronize()  # no copy may still read a workspace that is freed here
        self._streams.clear()
        self._workspaces.clear()
        for name in self._served:
            if _serving.get(name) is self:
                del _serving[name]
        self._served.clear()


@dataclass(frozen=True)
class CommOverlap:
    """A layer's --tp-comm-overlap: the transport ('nccl' or 'copy-engine') and the resources of
    the layout whose tensor-parallel group carries it (`ParallelGroups.comm_overlap`)."""

    transport: str
    resources: CommResources


def transport_of(overlap: str | CommOverlap) -> str:
    """The transport name of a layer's `comm_overlap` (a name or a `CommOverlap`)."""
    return overlap.transport if isinstance(overlap, CommOverlap) else overlap


def resources_of(overlap: str | CommOverlap, group) -> CommResources:
    """The resources a layer's `comm_overlap` uses on `group`."""
    return overlap.resources if isinstance(overlap, CommOverlap) else CommResources.of(group)
