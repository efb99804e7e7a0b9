"""A layout's communication resources (megadyn/core/comm_resources.py) belong to its
`ParallelGroups`: --tp-comm-overlap's workspaces are kept per group and shape, grown when
a transfer does not fit, and released by `destroy()`; a rebuilt layout starts with fresh ones
and no module-level table grows across layouts. Symmetric memory and side streams need CUDA,
so a stand-in allocator plays the workspace here; the arithmetic of the overlapped layers runs
in tests/core/test_tp_overlap.py."""

from types import SimpleNamespace

import pytest
import torch

from megadyn.core import comm_resources
from megadyn.core.comm_resources import CommOverlap, CommResources
from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megadyn.testing import spawn


class FakeHandle:
    """Stands in for torch's symmetric-memory handle: rank, world size and buffer views."""

    def __init__(self, world_size: int, nbytes: int):
        self.rank, self.world_size = 0, world_size
        self.memory = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(world_size)]

    def get_buffer(self, rank, shape, dtype):
        n = torch.Size(shape).numel() * dtype.itemsize
        return self.memory[rank][:n].view(dtype).view(shape)


def fake_allocate(calls: list):
    def allocate(group, nbytes, device):
        calls.append((group.group_name, nbytes))
        handle = FakeHandle(2, nbytes)
        return handle.memory, handle

    return allocate


def test_workspaces_are_kept_per_group_and_grow_to_fit():
    calls = []
    res = CommResources(allocate=fake_allocate(calls))
    tp = SimpleNamespace(group_name="7")
    small, large = torch.zeros(4, 2), torch.zeros(8, 4)
    handle, bufs = res.workspace_buffers(small, tp)
    assert len(bufs) == 2 and bufs[1].shape == small.shape
    assert res.workspace_buffers(small, tp) == (handle, bufs)  # kept: no second allocation
    assert calls == [("7", 32)]
    grown, _ = res.workspace_buffers(large, tp)  # does not fit: a larger one replaces it
    assert grown is not handle and calls == [("7", 32), ("7", 128)]
    assert res.workspace_buffers(small, tp)[0] is grown  # a smaller transfer fits the new one
    res.release()
    assert res.empty
    res.workspace_buffers(small, tp)  # after release: allocated afresh
    assert calls[-1] == ("7", 32)


def resources_body(rank, world):
    names = []
    for tp in (2, 1, 2):  # three layouts, one after another, as reconfiguration draws them
        groups = ParallelGroups.build(Layout(tp=tp, dp=world // tp), range(world))
        tp_group = groups.tp_group
        assert CommResources.of(tp_group) is groups.comm  # layers given a transport name
        assert dict(comm_resources._serving) == {tp_group.group_name: groups.comm}
        overlap = groups.comm_overlap("nccl")
        assert overlap == CommOverlap("nccl", groups.comm) and groups.comm_overlap(None) is None
        if tp > 1:  # the layers take the groups' overlap object like a transport name
            x = torch.randn(4, 2, 8)
            for cls in (ColumnParallelLinear, RowParallelLinear):
                kw = dict(sequence_parallel=True, grad_accumulation_fusion=False)
                layers = [cls(8, 8, tp_group, comm_overlap=o, **kw) for o in ("nccl", overlap)]
                with torch.no_grad():
                    layers[1].weight.copy_(layers[0].weight.normal_())
                    layers[1].bias.copy_(layers[0].bias.zero_())
                inp = x[:2] if cls is ColumnParallelLinear else x[..., : 8 // tp]
                assert torch.equal(layers[0](inp), layers[1](inp))
        calls = []
        groups.comm._allocate = fake_allocate(calls)
        groups.comm.workspace_buffers(torch.zeros(4), tp_group)
        assert calls and not groups.comm.empty
        comm = groups.comm
        groups.destroy()
        assert comm.empty and len(comm_resources._serving) == 0
        with pytest.raises(RuntimeError, match="belongs to no live ParallelGroups"):
            CommResources.of(tp_group)
        names.append(tp_group.group_name)
    assert len(set(names)) == 3  # names are never reused: a table keyed by them would grow


def test_destroy_releases_what_the_layout_communication_kept():
    spawn(resources_body, world=2)


def gpu_body(rank, world):
    """The copy-engine all-gather through a layout's resources, over three layouts in turn:
    each equals NCCL's all-gather, and the device memory in use after destroy() does not grow
    from one layout to the next (a workspace kept per group name adds 64 MiB each time)."""
    import torch.distributed as dist

    from megadyn.core.tensor_parallel.sp_overlap import _all_gather_start

    torch.cuda.set_device(rank)
    nbytes, used = 64 << 20, []
    for step in range(3):
        groups = ParallelGroups.build(Layout(tp=2), range(world), backend="nccl")
        x = torch.randn(4096, 2, 2048, device="cuda") + rank  # [s/tp, b, h] fp32, 64 MiB
        expected = torch.empty(8192, 2, 2048, device="cuda")
        dist.all_gather_into_tensor(expected, x, group=groups.tp_group)
        for overlap in (groups.comm_overlap("copy-engine"), "copy-engine"):
            out, wait = _all_gather_start(x, groups.tp_group, overlap)
            wait()
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
            del out
        assert not groups.comm.empty
        del x, expected
        torch.cuda.synchronize()
        groups.destroy()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()  # symmetric memory is not torch's allocator's
        used.append(total - free)
        print(f"rank {rank} layout {step}: {used[-1] >> 20} MiB in use after destroy()")
        assert len(comm_resources._serving) == 0
    assert used[-1] - used[0] < nbytes, used


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_copy_engine_resources_on_gpus():
    spawn(gpu_body, world=2, timeout_s=300)
