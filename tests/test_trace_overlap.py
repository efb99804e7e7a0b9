"""megadyn/bench/trace_overlap.py: exposed communication and idle time from a kernel timeline."""

import pytest

from megadyn.bench import trace_overlap


def kernel(name, ts, dur, pid=0):
    return dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur, pid=pid, tid=7)


def test_exposed_communication_is_nccl_time_without_compute():
    trace = dict(
        traceEvents=[
            kernel("sm90_xmma_gemm_bf16", 0, 10),
            kernel("layer_norm_kernel", 20, 10),
            kernel("ncclDevKernel_AllGather_RING_LL", 5, 20),  # 10 of its 20 us alone
            kernel("ncclDevKernel_ReduceScatter", 40, 5),  # alone, after 10 us idle
            kernel("nvjet_tst_gemm", 22, 4),  # inside the layer norm's interval
            kernel("Memcpy PtoP (Device -> Device)", 20, 4) | dict(cat="gpu_memcpy"),
            kernel("sm90_xmma_gemm_bf16", 0, 999, pid=1),  # another device: ignored
            dict(ph="X", cat="cpu_op", name="aten::mm", ts=0, dur=500, pid=0),
        ]
    )
    got = trace_overlap.summarize(trace, steps=1)
    assert got["window"] == pytest.approx(0.045)
    assert got["busy"] == pytest.approx(0.035)
    assert got["compute"] == pytest.approx(0.020)
    assert got["comm"] == pytest.approx(0.025)  # the copy ran within the all-gather
    assert got["exposed_comm"] == pytest.approx(0.015)
    assert got["idle"] == pytest.approx(0.010)
    assert got["gemm_sum"] == pytest.approx(0.014)
    assert got["kernels"] == 6
    assert got["transfers"] == {
        "Memcpy PtoP (Device -> Device)": [1, 0.004, 0.0],
        "ncclDevKernel_AllGather_RING_LL": [1, 0.02, 0.01],
        "ncclDevKernel_ReduceScatter": [1, 0.005, 0.005],
    }
    halved = trace_overlap.summarize(trace, steps=2)
    assert halved["exposed_comm"] == pytest.approx(0.0075)


def test_a_trace_without_gpu_kernels_is_refused():
    with pytest.raises(ValueError, match="no GPU kernel events"):
        trace_overlap.summarize(dict(traceEvents=[kernel("x", 0, 1) | dict(cat="cpu_op")]))


def test_the_kernel_timeline_is_written_in_start_order(tmp_path):
    import csv
    import gzip

    trace = dict(traceEvents=[kernel("late_gemm", 9, 2), kernel("ncclDevKernel_AllGather", 1, 5)])
    path = tmp_path / "kernels.csv.gz"
    trace_overlap.write_kernels_csv(trace, str(path))
    with gzip.open(path, "rt") as f:
        rows = list(csv.reader(f))
    assert rows == [
        ["ts", "dur", "stream", "name"],
        ["1", "5", "7", "ncclDevKernel_AllGather"],
        ["9", "2", "7", "late_gemm"],
    ]
