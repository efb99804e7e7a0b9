"""`python -m megadyn.bench NAME` (megadyn/bench/__main__.py): every benchmark listed and
importable, NAME's flags passed on, an unknown NAME refused with the list."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megadyn.bench.__main__ import BENCHMARKS, main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_each_benchmark_names_a_callable(name):
    module, _, function = BENCHMARKS[name][0].partition(":")
    m = importlib.import_module(module)
    names = [function] if function else ["parse", "main", "summarize"]  # run_compare_tool's
    assert all(callable(getattr(m, n)) for n in names)


def test_help_lists_them_and_an_unknown_name_is_refused(capsys):
    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in BENCHMARKS)
    assert main(["no_such_bench"]) == 2
    assert "no benchmark 'no_such_bench'" in capsys.readouterr().err


def test_flags_reach_the_benchmark(tmp_path):
    rows = [("megatron-core", 100.0), ("megadyn", 150.0)]
    path = tmp_path / "results.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                dict(row="tp1", framework=fw, tokens_per_s_per_gpu=t, mfu=0.5, peak_mem_gib=1.0)
            )
            + "\n"
            for fw, t in rows
        )
    )
    cmd = [sys.executable, "-m", "megadyn.bench", "table", str(path)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "| tp1 | 100 | 150 | 1.500 |" in done.stdout
