"""scripts/gpu/titan_compare.sh and megadyn/bench/titan_compare.py on the CPU: the commands of a
dry run (every row by both frameworks, which one first alternating by round; megadyn's flags
parse as tools/bench_gpt.py's and give issue 40's 1.50 B Llama; torchtitan's FSDP float8
settings on the 2-GPU fp8 row only), and the table and JSON of a run."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

from megadyn.bench.gpt import parse_args
from megadyn.bench.gpt_model import model_record
from megadyn.bench.titan_compare import summarize

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "scripts/gpu/titan_compare.sh"
FSDP_FP8 = "--quantize.linear.float8.enable_fsdp_float8_all_gather"


def dry_run(tmp_path, **env) -> list[tuple[str, str, int, list[str]]]:
    """(framework, row, round, command) of each run the script would start."""
    env = dict(os.environ, DRY_RUN="1", PYTHONPATH=str(REPO), **env)
    done = subprocess.run(
        ["bash", SCRIPT, str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    runs = []
    for line in done.stdout.splitlines():
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
esac
"""


def test_a_run_with_stubbed_launchers_writes_its_table(tmp_path):
    """The real (not dry) path with `torchrun` and `nvidia-smi` stubbed: each run's JSON line
    reaches results.jsonl, and OUTDIR holds the table, the summary, env.txt and the logs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("torchrun", STUB), ("nvidia-smi", "#!/bin/sh\necho stub GPU\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(REPO))
    env.update(NGPU="2", TT_OK="1", TT_WHEELS=str(tmp_path / "none"))
    done = subprocess.run(
        ["bash", SCRIPT, str(out)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
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
