"""megadyn/core/c10d_compat.py: torch's private c10d parts, each checked for real.

- its self-test (`python -m megadyn.core.c10d_compat`) under torchrun with 2 gloo processes:
  one test per function, failing with the reason its check printed (scripts/gpu/smoke.sh runs
  the same with NCCL on the GPU machine's torch);
- a name torch dropped is a TorchChanged error naming the torch version;
- no other module of megadyn reaches a private c10d name.
"""

import os
import pathlib
import re
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megadyn.core import c10d_compat
from megadyn.core.c10d_check import NAMES
from megadyn.testing.spawn import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def self_test() -> dict[str, str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "megadyn.core.c10d_compat",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    lines = dict(re.findall(r"^c10d_compat: (\w+): (.*)$", out.stdout, re.M))
    assert lines, out.stdout + out.stderr
    lines["returncode"] = str(out.returncode)
    return lines


@pytest.mark.parametrize("name", NAMES)
def test_function_works_on_this_torch(self_test, name):
    assert self_test.get(name) == "ok", f"torch {torch.__version__}: {name}: {self_test.get(name)}"


def test_self_test_exit_status(self_test):
    assert self_test["returncode"] == "0"


def test_a_dropped_name_is_an_error_naming_the_torch_version(monkeypatch):
    monkeypatch.delattr(dist.distributed_c10d, "_set_pg_timeout")
    with pytest.raises(c10d_compat.TorchChanged, match=re.escape(f"torch {torch.__version__}")):
        c10d_compat.set_group_timeout(None, timedelta(seconds=1))


def test_private_c10d_names_are_reached_only_through_the_compat_module():
    private = re.compile(r"distributed_c10d\._|_symmetric_memory|_set_sm_carveout|\._world\b")
    users = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in (ROOT / "megadyn").rglob("*.py")
        if path.name not in ("c10d_compat.py", "c10d_check.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line) and not line.lstrip().startswith("#")
    ]
    assert not users, f"private torch parts outside megadyn/core/c10d_compat.py: {users}"
