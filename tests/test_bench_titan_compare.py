"""scripts/gpu/titan_compare.sh and megadyn/bench/titan_compare.py on the CPU: the commands of a
dry run (every row by every framework, which one first alternating by round; megadyn's flags
parse as tools/bench_gpt.py's and give issue 40's 1.50 B Llama, Megatron-Core's as
scripts/gpu/mcore_llama_bench.py's with the same model and FLOPs count; torchtitan's FSDP float8
settings on the 2-GPU fp8 row only; Megatron-Core's fp8 rows n/a), and the table and JSON of a
run. Where megatron.core imports (not in CI), mcore_llama_bench.py's CPU check builds a small
model of the same architecture with Megatron-Core's local spec."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megadyn.bench.gpt import parse_args
from megadyn.bench.gpt_model import model_record
from megadyn.bench.titan_compare import summarize

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "scripts/gpu/titan_compare.sh"
MCORE_SCRIPT = REPO / "scripts/gpu/mcore_llama_bench.py"
FSDP_FP8 = "--quantize.linear.float8.enable_fsdp_float8_all_gather"


def mcore_bench():
    """scripts/gpu/mcore_llama_bench.py as a module (it imports megatron.core only when run)."""
    spec = importlib.util.spec_from_file_location("mcore_llama_bench", MCORE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dry_run(tmp_path, skipped=None, **env) -> list[tuple[str, str, int, list[str]]]:
    """(framework, row, round, command) of each run the script would start; the runs it
    would skip are appended to `skipped` as (framework, row, round, why)."""
    env = dict(os.environ, DRY_RUN="1", PYTHONPATH=str(REPO), **env)
    done = subprocess.run(
        ["bash", SCRIPT, str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    runs = []
    for line in done.stdout.splitlines():
        if line.startswith("skipped ("):
            why, _, what = line[len("skipped (") :].rpartition("): ")
            fw, row, _, round_ = what.split()
            (skipped if skipped is not None else []).append((fw, row, int(round_), why))
            continue
        head, _, command = line.partition("): ")
        _, fw, row, _, round_ = head.split()[:5]
        runs.append((fw, row, int(round_), shlex.split(command)))
    return runs


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", SCRIPT], cwd=REPO).returncode == 0


def test_rounds_alternate_which_framework_goes_first(tmp_path):
    runs = dry_run(tmp_path, ROUNDS="2")
    rows = ["1gpu_bf16", "1gpu_fp8", "2gpu_bf16", "2gpu_fp8"]
    first = [(fw, row, 1) for row in rows for fw in ("megadyn", "torchtitan")]
    second = [(fw, row, 2) for row in rows for fw in ("torchtitan", "megadyn")]
    assert [r[:3] for r in runs] == first + second


def test_megatron_core_joins_the_rotation_where_asked(tmp_path):
    """MCORE_ROWS adds Megatron-Core as the third framework (the order reversed in round 2);
    its fp8 rows say why they do not run, and so do rows not in MCORE_ROWS."""
    skipped = []
    runs = dry_run(tmp_path, skipped, ROUNDS="2", MCORE_ROWS="1gpu_bf16 2gpu_bf16")
    rows = ["1gpu_bf16", "1gpu_fp8", "2gpu_bf16", "2gpu_fp8"]
    order = ["megadyn", "torchtitan", "megatron-core"]
    expected = [
        (fw, row, n)
        for n, fws in ((1, order), (2, order[::-1]))
        for row in rows
        for fw in fws
        if not (fw == "megatron-core" and row.endswith("fp8"))
    ]
    assert [r[:3] for r in runs] == expected
    na = "n/a: needs Transformer Engine"
    assert skipped == [("megatron-core", r, n, na) for n in (1, 2) for r in rows if "fp8" in r]
    skipped.clear()
    runs = dry_run(tmp_path, skipped, ONLY="1gpu_bf16 2gpu_bf16", MCORE_ROWS="2gpu_bf16")
    assert [r[:2] for r in runs if r[0] == "megatron-core"] == [("megatron-core", "2gpu_bf16")]
    assert skipped == [("megatron-core", "1gpu_bf16", 1, "not in MCORE_ROWS")]


def test_megatron_core_runs_the_same_llama(tmp_path):
    """Its flags are megadyn's model flags; mcore_llama_bench.py reads them as issue 40's model
    and counts the step's FLOPs as megadyn does (one MFU formula for all three)."""
    bench = mcore_bench()
    runs = dry_run(tmp_path, MCORE_ROWS="1gpu_bf16 2gpu_bf16", MCORE_ARGS="--attn local")
    mcore = {row: cmd for fw, row, _, cmd in runs if fw == "megatron-core"}
    megadyn = {row: cmd for fw, row, _, cmd in runs if fw == "megadyn"}
    assert sorted(mcore) == ["1gpu_bf16", "2gpu_bf16"]
    for row, cmd in mcore.items():
        gpus = 1 if row.startswith("1gpu") else 2
        assert cmd[cmd.index("--nproc-per-node") + 1] == str(gpus)
        a = bench.parse(cmd[cmd.index(str(MCORE_SCRIPT.relative_to(REPO))) + 1 :])
        assert (a.layers, a.hidden, a.heads, a.num_query_groups, a.ffn_hidden_size) == (
            16, 2048, 32, 8, 8192,
        )  # fmt: skip
        assert (a.vocab, bench.padded_vocab(a), a.seq, a.mbs, a.gbs // gpus) == (
            128256, 128256, 4096, 2, 8,
        )  # fmt: skip
        assert a.swiglu and a.normalization == "RMSNorm" and a.disable_bias_linear
        assert (a.position_embedding_type, a.rotary_base) == ("rope", 500000)
        assert a.untie_embeddings_and_output_weights and a.attn == "local"
        assert (a.iters, a.warmup) == (8, 3)
        m = parse_args(megadyn[row][megadyn[row].index("tools/bench_gpt.py") + 1 :])
        assert bench.flops_per_iteration(a) == model_record(m)["flops_per_iter"]
    with pytest.raises(SystemExit):  # no FP8 without Transformer Engine
        bench.parse(["--fp8-format", "hybrid"])


def test_megadyn_runs_the_llama_of_issue_40(tmp_path):
    for fw, row, _, cmd in dry_run(tmp_path, ONLY="1gpu_bf16 2gpu_fp8"):
        gpus = 1 if row.startswith("1gpu") else 2
        assert cmd[cmd.index("--nproc-per-node") + 1] == str(gpus)
        if fw == "torchtitan":
            assert cmd[cmd.index("--training.global_batch_size") + 1] == str(8 * gpus)
            assert "--compile.enable" in cmd
            assert ("quantize.linear.float8" in cmd) == (FSDP_FP8 in cmd) == (row == "2gpu_fp8")
            continue
        a = parse_args(cmd[cmd.index("tools/bench_gpt.py") + 1 :])
        model = model_record(a)
        assert (model["arch"], model["query_groups"], model["ffn"]) == (
            "rope/RMSNorm/swiglu/nobias", 8, 8192,
        )  # fmt: skip
        assert round(model["params"] / 1e9, 2) == 1.50
        assert (a.seq, a.mbs, a.gbs // gpus, a.cuda_graph) == (4096, 2, 8, True)
        assert a.fp8_format == ("hybrid" if row.endswith("fp8") else None)


STUB = """#!/usr/bin/env bash
case "$*" in
  *tools/bench_gpt.py*) echo '{"framework": "megadyn", "tokens_per_s_per_gpu": 60000.0, "mfu": 0.55, "peak_mem_gib": 33.0}' ;;
  *tt_run.py*) echo 'step: 1'; echo 'BENCH_JSON {"framework": "torchtitan", "tokens_per_s_per_gpu": 50000.0, "mfu": 0.45, "peak_mem_gib": 30.0, "peak_reserved_gib": 31.0}' ;;
  *mcore_llama_bench.py*) echo 'BENCH_JSON {"framework": "megatron-core", "tokens_per_s_per_gpu": 48000.0, "mfu": 0.44, "peak_mem_gib": 35.0, "peak_reserved_gib": 37.5}' ;;
esac
"""


def stubbed_run(tmp_path, **env) -> Path:
    """The script's real (not dry) path with `torchrun` and `nvidia-smi` stubbed: OUTDIR."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("torchrun", STUB), ("nvidia-smi", "#!/bin/sh\necho stub GPU\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(REPO), **env)
    env.update(NGPU="2", TT_OK="1", TT_WHEELS=str(tmp_path / "none"))
    done = subprocess.run(
        ["bash", SCRIPT, str(out)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_a_run_with_stubbed_launchers_writes_its_table(tmp_path):
    """Each run's JSON line reaches results.jsonl, and OUTDIR holds the table, the summary,
    env.txt and the logs; without MCORE_ROWS the table is megadyn's and torchtitan's alone."""
    out = stubbed_run(tmp_path)
    assert sorted(p.name for p in out.iterdir()) == [
        "env.txt", "logs.tgz", "results.jsonl", "summary.json", "table.md",
    ]  # fmt: skip
    table = (out / "table.md").read_text()
    for row in ("1gpu_bf16", "1gpu_fp8", "2gpu_bf16", "2gpu_fp8"):
        assert (
            f"| {row} | 60,000 (55.0%) | 50,000 (45.0%) | 1.200 | 1.200 | 33.0 | 30.0 (31.0) |"
            in table
        )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["2gpu_fp8"]["ratio"] == 1.2
    assert "Megatron-Core" not in table and "megatron-core" not in summary["1gpu_bf16"]


def test_a_stubbed_run_with_megatron_core(tmp_path):
    """MCORE_ROWS: Megatron-Core's runs reach the table (megadyn / Megatron-Core, its peak
    allocated and reserved); its fp8 and unasked rows say why they are empty."""
    out = stubbed_run(tmp_path, MCORE_ROWS="1gpu_bf16", MCORE_OK="1")
    table = (out / "table.md").read_text()
    assert (
        "| 1gpu_bf16 | 60,000 (55.0%) | 50,000 (45.0%) | 48,000 (44.0%) | 1.200 | 1.200 "
        "| 1.250 | 1.250 | 33.0 | 30.0 (31.0) | 35.0 (37.5) |" in table
    )
    assert "| 1gpu_fp8 | 60,000 (55.0%) | 50,000 (45.0%) | n/a: needs Transformer Engine |" in table
    assert "| 2gpu_bf16 | 60,000 (55.0%) | 50,000 (45.0%) | not in MCORE_ROWS |" in table
    summary = json.loads((out / "summary.json").read_text())
    assert summary["1gpu_bf16"]["ratio_megatron_core"] == 1.25
    assert summary["1gpu_bf16"]["megatron-core"]["peak_reserved_gib"] == 37.5
    assert summary["2gpu_fp8"]["skipped"] == {"megatron-core": "n/a: needs Transformer Engine"}
    # Megatron-Core not installed: its rows say why, the others still run
    out = stubbed_run(tmp_path, ONLY="1gpu_bf16", MCORE_ROWS="1gpu_bf16", MCORE_OK="0")
    table = (out / "table.md").read_text()
    assert "| 1gpu_bf16 | 60,000 (55.0%) | 50,000 (45.0%) | not ready: MCORE_OK=0 given |" in table


def test_the_table_and_summary_of_a_run(tmp_path):
    recs = [
        ("megadyn", 1, 60000.0, 40.0), ("torchtitan", 1, 50000.0, 35.0),
        ("torchtitan", 2, 52000.0, 35.0), ("megadyn", 2, 57200.0, 40.0),
    ]  # fmt: skip
    lines = [
        dict(row="1gpu_bf16", round=n, framework=fw, tokens_per_s_per_gpu=t, mfu=0.5,
             peak_mem_gib=m, **({"peak_reserved_gib": 36.0} if fw == "torchtitan" else {}))
        for fw, n, t, m in recs
    ]  # fmt: skip
    lines.append(
        dict(
            row="2gpu_fp8",
            round=1,
            framework="megadyn",
            tokens_per_s_per_gpu=1.0,
            mfu=0.1,
            peak_mem_gib=1.0,
        )
    )  # torchtitan's run of the row failed: no line
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    table, summary = summarize(str(path))
    assert (
        "| 1gpu_bf16 | 58,600 (50.0%) | 51,000 (50.0%) | 1.149 | 1.200 1.100 | 40.0 | 35.0 (36.0) |"
        in table
    )
    assert summary["1gpu_bf16"]["ratios_per_round"] == [1.2, 1.1]
    assert summary["2gpu_fp8"]["torchtitan"] is None and summary["2gpu_fp8"]["ratio"] is None


def test_the_table_of_three_frameworks(tmp_path):
    """A results.jsonl with megadyn, torchtitan and Megatron-Core over two rounds, and skipped
    lines: medians, both ratios per round, reserved memory, the reasons in the cells."""
    recs = [
        ("megadyn", 1, 60000.0), ("torchtitan", 1, 50000.0), ("megatron-core", 1, 40000.0),
        ("megatron-core", 2, 44000.0), ("torchtitan", 2, 52000.0), ("megadyn", 2, 57200.0),
    ]  # fmt: skip
    lines = [
        dict(row="2gpu_bf16", round=n, framework=fw, tokens_per_s_per_gpu=t, mfu=t / 1e5,
             peak_mem_gib=30.0, wall_s=40 + n, **({} if fw == "megadyn" else {"peak_reserved_gib": 32.0}))
        for fw, n, t in recs
    ]  # fmt: skip
    lines += [
        dict(row="2gpu_fp8", round=1, framework="megadyn", tokens_per_s_per_gpu=70000.0, mfu=0.6,
             peak_mem_gib=31.0),
        dict(row="2gpu_fp8", round=1, framework="torchtitan", skipped="budget"),
        dict(row="2gpu_fp8", round=1, framework="megatron-core",
             skipped="n/a: needs Transformer Engine"),
    ]  # fmt: skip
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    table, summary = summarize(str(path))
    head, rule, bf16, fp8 = table.splitlines()
    assert head.count("|") == rule.count("|") == bf16.count("|") == 12
    assert bf16 == (
        "| 2gpu_bf16 | 58,600 (58.6%) | 51,000 (51.0%) | 42,000 (42.0%) | 1.149 | 1.200 1.100 "
        "| 1.395 | 1.500 1.300 | 30.0 | 30.0 (32.0) | 30.0 (32.0) |"
    )
    assert fp8 == (
        "| 2gpu_fp8 | 70,000 (60.0%) | budget | n/a: needs Transformer Engine | - | - | - | - "
        "| 31.0 | - (-) | - (-) |"
    )
    s = summary["2gpu_bf16"]
    assert (s["ratio"], s["ratio_megatron_core"]) == (1.149, 1.395)
    assert s["ratios_per_round_megatron_core"] == [1.5, 1.3]
    assert s["megatron-core"]["wall_s"] == 41.5 and s["megadyn"]["peak_reserved_gib"] is None
    assert summary["2gpu_fp8"]["torchtitan"] is None
    assert summary["2gpu_fp8"]["skipped"] == {
        "torchtitan": "budget", "megatron-core": "n/a: needs Transformer Engine",
    }  # fmt: skip


@pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)
def test_megatron_core_builds_the_architecture_on_the_cpu():
    """mcore_llama_bench.py --device cpu: Megatron-Core's local spec builds a small model of the
    Llama architecture (torch RMSNorm, no biases, GQA's narrower QKV, SwiGLU's doubled fc1,
    RoPE, untied output layer, the SDPA core attention), runs forward and backward, and has as
    many weights as megadyn's model of the same flags."""
    flags = (
        "--layers 2 --hidden 64 --heads 8 --group-query-attention --num-query-groups 2 "
        "--ffn-hidden-size 256 --vocab 1024 --seq 32 --mbs 2 --gbs 4 --swiglu "
        "--normalization RMSNorm --position-embedding-type rope --rotary-base 500000 "
        "--disable-bias-linear --untie-embeddings-and-output-weights"
    ).split()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    done = subprocess.run(
        [sys.executable, str(MCORE_SCRIPT), "--device", "cpu", "--iters", "1", "--warmup", "1"]
        + flags,
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("BENCH_JSON ")]
    rec = json.loads(line.removeprefix("BENCH_JSON "))
    assert rec["arch"] == dict(
        norm="RMSNorm", final_norm="RMSNorm", qkv=[64 + 2 * 2 * 8, 64], fc1=[2 * 256, 64],
        biases=0, rope=True, untied=True, core_attention="SDPAAttention",
    )  # fmt: skip
    assert 6.0 < rec["loss"] < 8.0  # about ln(1024) = 6.93 at initialization
    m = model_record(parse_args(flags))
    assert (rec["params"], rec["flops_per_iter"]) == (m["params"], m["flops_per_iter"])
