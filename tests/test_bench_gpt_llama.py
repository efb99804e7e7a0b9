"""tools/bench_gpt.py on a tiny Llama shape, as a user runs it (torchrun, gloo, 2 processes):
pretrain_gpt.py's architecture flags build pretrain_gpt.py's model, and the record counts its
FLOPs and parameters by the model's own formulas (checked against a hand count)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megadyn.bench.gpt import job_config, parse_args
from megadyn.bench.gpt_model import model_record
from megadyn.testing import free_port
from megadyn.training.arguments import parse_config

REPO = Path(__file__).resolve().parents[1]
SHAPE = (
    "--layers 2 --hidden 64 --heads 4 --ffn-hidden-size 160 --vocab 256 --seq 32 --mbs 2 --gbs 4"
)
LLAMA = (
    "--swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 500000 "
    "--disable-bias-linear --group-query-attention --num-query-groups 2 "
    "--untie-embeddings-and-output-weights"
)


def test_the_llama_flags_build_pretrain_gpts_model():
    bench = job_config(parse_args((SHAPE + " " + LLAMA).split())).model
    pretrain = parse_config(
        (
            "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 160 "
            "--seq-length 32 --vocab-size 256 --micro-batch-size 2 --global-batch-size 4 "
            "--train-iters 1 --lr 1e-4 --bf16 --hidden-dropout 0 --attention-dropout 0 " + LLAMA
        ).split(),
        world_size=1,
    ).model
    assert bench == pretrain
    assert (bench.activation, bench.normalization, bench.query_groups) == ("swiglu", "RMSNorm", 2)
    assert (bench.position_embedding_type, bench.rotary_base, bench.add_bias_linear) == (
        "rope", 500000.0, False,
    )  # fmt: skip


def test_the_pointwise_fusion_flags_reach_the_model_and_the_record():
    a = parse_args((SHAPE + " " + LLAMA + " --pointwise-fusion --no-rope-fusion").split())
    model = job_config(a).model
    assert model.pointwise_fusion and not model.apply_rope_fusion and model.bias_swiglu_fusion
    assert model_record(a)["pointwise_fusion"] == "norm+swiglu+residual"
    assert model_record(parse_args((SHAPE + " " + LLAMA).split()))["pointwise_fusion"] is None


def test_groups_without_grouped_query_attention_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args((SHAPE + " --num-query-groups 2").split())
    assert "--num-query-groups: add --group-query-attention" in capsys.readouterr().err


def test_a_tiny_llama_through_the_tool_counts_its_flops_by_hand():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port()), "tools/bench_gpt.py", "--tp", "2"]
    cmd += (SHAPE + " " + LLAMA + " --iters 2 --warmup 1").split()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("{")]
    rec = json.loads(line)
    h, kv, ffn, vocab, layers, s, b = 64, 2 * 64 // 4, 160, 256, 2, 32, 4
    # per token and layer: QKV (GQA: h + 2 kv), out projection, SwiGLU's three matrices
    matmul_per_layer = h * (h + 2 * kv) + h * h + 3 * h * ffn  # 43,008
    per_token = 6 * (layers * matmul_per_layer + h * vocab) + 12 * layers * h * s  # 663,552
    assert rec["flops_per_iter"] == b * s * per_token == 84_934_656
    norms = 2 * h  # two RMSNorm weights a layer, no biases
    params = vocab * h + layers * (matmul_per_layer + norms) + h + h * vocab  # untied output
    assert rec["params"] == params == 119_104
    assert (rec["arch"], rec["query_groups"], rec["ffn"], rec["tp"]) == (
        "rope/RMSNorm/swiglu/nobias", 2, 160, 2,
    )  # fmt: skip
