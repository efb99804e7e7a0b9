"""megadyn/bench/gpt.py (tools/bench_gpt.py) on CPU: one record with the reference script's
fields, timed on the model, wrappers and optimizer that training builds."""

import gc

import pytest
import torch

from megadyn.testing import spawn

TINY = "--layers 2 --hidden 64 --heads 4 --seq 32 --vocab 256 --mbs 2 --gbs 4".split()
FIELDS = [
    "framework", "tp", "pp", "vpp", "dp", "distopt_instances", "precision_aware_optimizer", "sharding_strategy", "sp", "cp", "cp_comm_type",
    "cp_placement", "cp_block_size", "documents", "cuda_graph", "tp_comm_overlap", "tp_comm_overlap_transport", "gemm_sm_carveout", "fp8", "attn",
    "attention_backend", "recompute", "keep_fc2_input", "keep_norm_outputs", "cross_entropy_chunks", "layers", "hidden", "seq", "mbs", "gbs", "iter_s",
    "iters_s", "warmup_iter_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "peak_mem_gib", "resident_mem_gib",
    "arch", "pointwise_fusion", "heads", "query_groups", "ffn", "vocab", "params", "flops_per_iter",
]  # fmt: skip


def _live_tensor_bytes() -> int:
    gc.collect()
    return sum(
        o.untyped_storage().nbytes()
        for o in gc.get_objects()
        if torch.is_tensor(o) and o._base is None and o.device.type == "cpu"
    )


def _bench(rank, world, flags):
    """The record, and the bytes of tensors that outlive the run (tools/bench_cp_compare.py
    runs many in one process)."""
    from megadyn.bench.gpt import parse_args, run_gpt_bench

    before = _live_tensor_bytes()
    record = run_gpt_bench(parse_args(flags), torch.device("cpu"))
    return record, _live_tensor_bytes() - before


@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (1, 2)])
def test_the_record_has_the_reference_fields(tp, cp):
    flags = TINY + ["--tp", str(tp), "--cp", str(cp), "--iters", "2", "--warmup", "1"]
    if cp > 1:  # on packed documents, placed per micro batch
        flags += ["--documents", "8:1", "--cp-placement", "dynamic", "--cp-block-size", "4"]
    (first, left), (second, _) = spawn(_bench, world=2, args=(flags,))
    assert left == 0  # the job (weights, buffers, optimizer) is gone after the run
    assert list(first) == FIELDS
    assert (first["tp"], first["cp"], first["dp"], first["gbs"]) == (tp, cp, 2 // (tp * cp), 4)
    assert first["cp_placement"] == ("dynamic" if cp > 1 else None)
    assert len(first["iters_s"]) == 2 and len(first["warmup_iter_s"]) == 1
    assert first["tokens_per_s_per_gpu"] > 0
    assert first["peak_mem_gib"] == second["peak_mem_gib"] == 0.0  # no CUDA memory on CPU
    assert first["precision_aware_optimizer"] is False


def test_the_precision_aware_optimizer_flag_reaches_the_job():
    from megadyn.bench.gpt import job_config, parse_args

    cfg = job_config(parse_args(TINY + ["--use-precision-aware-optimizer"]))
    assert cfg.optimizer.use_precision_aware_optimizer and cfg.optimizer.bf16
