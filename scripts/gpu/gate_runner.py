"""The GPU gate's processes: each check's runs, its deadline, and what is left when it stops.

scripts/gpu/smoke.py makes a `Gate` and calls `run_check` for each check of gate_checks.py. A
process starts in a session of its own and is killed with all its descendants (torchrun starts
each worker in a session of its own too); its output goes to a file, and a check's files end up
in OUTDIR/<check>.log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import gate_report as report
from gate_report import BF16_LOSS_TOL, CheckResult, fail

REPO = Path(__file__).resolve().parents[2]
RECORD_FILE = REPO / "docs" / "gpu-checks.jsonl"
PY = sys.executable
T0 = time.monotonic()
PORTS = {
    "live_change": 29611,
    "kill9_rdzv": 29621,
    "kill9_ctl": 29622,
    "kill9_base": 29623,
    "sigterm_drain": 29631,
    "lost_host_ctl": 29641,
}
"""Fixed ports of the runs that need one (elastic control stores, the launcher's rendezvous);
the other runs take torchrun --standalone's free port."""


class CheckTimeout(Exception):
    """The check's time (or the gate's) is spent."""


# --- processes: started in a session of their own, killed with every descendant ----------------
def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every process /proc shows."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        table[int(entry)] = (int(fields[1]), int(fields[3]))
    return table


def kill_tree(root: int) -> None:
    """SIGKILL `root`, its descendants and every process in their sessions (torchrun starts
    each worker in a session of its own; a killed parent's children are reparented, so the
    sessions catch what the tree no longer shows)."""
    own = os.getsid(0)
    for _ in range(3):
        table = process_table()
        tree, todo = {root}, [root]
        while todo:
            parent = todo.pop()
            kids = [p for p, (pp, _) in table.items() if pp == parent and p not in tree]
            tree.update(kids)
            todo += kids
        sessions = {table[p][1] for p in tree if p in table} - {own}
        victims = {p for p, (_, s) in table.items() if s in sessions} | (tree & set(table))
        victims.discard(os.getpid())
        if not victims:
            return
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def worker_pid(launcher: int, rank: int) -> int | None:
    """The pid of the torchrun worker of global rank `rank` under launcher pid `launcher`."""
    for pid, (ppid, _) in process_table().items():
        if ppid != launcher:
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if report.environ_value(environ, "RANK") == str(rank):
            return pid
    return None


@dataclass
class Proc:
    """One process (tree) of a check: its command, log and, for a training run, metrics file."""

    name: str
    cmd: list[str]
    log: Path
    popen: subprocess.Popen
    started: float
    metrics: Path | None = None
    ended: float | None = None

    def code(self) -> int | None:
        code = self.popen.poll()
        if code is not None and self.ended is None:
            self.ended = time.monotonic()
        return code

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self) -> None:
        if self.code() is None:
            kill_tree(self.popen.pid)
            self.popen.wait()
            self.code()


def base_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # NVLink multicast stays off (it can take a shared host's GPUs out of service)
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def torchrun(nproc: int, *args: str) -> list[str]:
    return [
        PY,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        *args,
    ]


# --- the gate: checks, each with its deadline and processes ---------------------------------------
class Gate:
    def __init__(self, checks: dict, out: Path, work: Path, budget_s: float, models, device: dict):
        self.checks, self.out, self.work = checks, out, work
        self.models, self.device = models, device
        self.width = 1 if device["count"] == 1 else 2
        """Processes of a multi-process check: 2, or 1 on a machine of one GPU."""
        self.end = time.monotonic() + budget_s
        self.shared: dict[str, Proc] = {}
        self.procs: list[Proc] = []  # every check's, for kill_all
        self.stopping = False  # set when the gate is stopped: no process starts any more
        self.lock, self.shared_lock = threading.Lock(), threading.Lock()
        self.previous_lines = RECORD_FILE.read_text().splitlines() if RECORD_FILE.exists() else []

    def run_check(self, name: str) -> CheckResult:
        fn, timeout = self.checks[name]
        c = Check(self, name, timeout)
        t0 = time.monotonic()
        try:
            if c.left() <= 0:
                result = fail(name, "no time", "the gate's --budget-s was spent before it started")
            else:
                result = fn(c)
        except CheckTimeout:
            result = fail(name, "timeout", f"over its {timeout} s or the gate's --budget-s")
        except Exception as e:  # noqa: BLE001 - a broken check is a failed row, not a dead gate
            c.note(traceback.format_exc())
            result = fail(name, "error", f"{type(e).__name__}: {e}")
        finally:
            c.close()
        result.seconds = time.monotonic() - t0
        verdict = f"{'pass' if result.passed else 'FAIL'} {report.format_figure(result.figure)}"
        c.note(f"verdict: {verdict} | {result.reason}")
        c.write_log()
        print(f"[{elapsed()}] {name}: {verdict} {result.reason}", flush=True)
        return result

    def kill_all(self) -> None:
        """Every process any check started (the gate itself is being stopped)."""
        with self.lock:
            procs = list(self.procs)
        for p in procs:
            p.kill()


class Check:
    """What one check started and when it must stop."""

    def __init__(self, gate: Gate, name: str, timeout: float):
        self.gate, self.name, self.models = gate, name, gate.models
        self.width = gate.width
        self.work = gate.work / name
        self.work.mkdir(parents=True, exist_ok=True)
        self.deadline = min(time.monotonic() + timeout, gate.end)
        self.procs: list[Proc] = []
        self.notes: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def note(self, text: str) -> None:
        self.notes.append(text.rstrip())

    def start(
        self,
        run: str,
        cmd: list[str],
        env: dict | None = None,
        where: Path | None = None,
        metrics: bool = False,
    ) -> Proc:
        if self.gate.stopping:
            raise CheckTimeout()
        where = where or self.work
        log = where / f"{run}.log"
        m = where / f"{run}.metrics.jsonl" if metrics else None
        if m is not None:
            m.unlink(missing_ok=True)
            cmd = [*cmd, "--metrics-file", str(m)]
        with open(log, "w") as f:
            popen = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env or base_env(),
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = Proc(run, cmd, log, popen, time.monotonic(), m)
        self.procs.append(proc)
        with self.gate.lock:
            self.gate.procs.append(proc)
        return proc

    def pretrain(self, run: str, nproc: int, flags: list[str], env: dict | None = None) -> Proc:
        """pretrain_gpt.py under torchrun --standalone, its metrics into <run>.metrics.jsonl."""
        return self.start(run, torchrun(nproc, "pretrain_gpt.py", *flags), env, metrics=True)

    def shared_pretrain(self, key: str, nproc: int, flags: list[str]) -> Proc:
        """A run that several checks compare with: started by the first that asks."""
        with self.gate.shared_lock:
            proc = self.gate.shared.get(key)
            if proc is None:
                where = self.gate.work / "shared"
                where.mkdir(exist_ok=True)
                cmd = torchrun(nproc, "pretrain_gpt.py", *flags)
                proc = self.gate.shared[key] = self.start(key, cmd, where=where, metrics=True)
            elif not any(p is proc for p in self.procs):
                self.procs.append(proc)
            return proc

    def wait(self, *procs: Proc, abort_if=None) -> None:
        """Until every one of `procs` exits; `abort_if()` true kills them (a job that died
        under an operator tool waiting for it); CheckTimeout at the deadline."""
        while any(p.code() is None for p in procs):
            if abort_if is not None and abort_if():
                for p in procs:
                    self.note(f"{p.name}: stopped, what it waited for ended")
                    p.kill()
                return
            if self.left() <= 0:
                raise CheckTimeout()
            time.sleep(0.2)

    def run(self, run: str, cmd: list[str], env: dict | None = None, abort_if=None) -> Proc:
        proc = self.start(run, cmd, env)
        self.wait(proc, abort_if=abort_if)
        return proc

    def wait_for(self, proc: Proc, found, what: str):
        """Until `found(proc's output so far)` is not None; returns it."""
        while True:
            hit = found(proc.text())
            if hit is not None:
                return hit
            if proc.code() is not None:
                raise RuntimeError(f"{proc.name} exited ({proc.code()}) before {what}")
            if self.left() <= 0:
                raise CheckTimeout()
            time.sleep(0.1)

    def close(self) -> None:
        for p in self.procs:
            p.kill()

    def write_log(self) -> None:
        with open(self.gate.out / f"{self.name}.log", "w") as f:
            for p in self.procs:
                secs = f"{(p.ended or time.monotonic()) - p.started:.1f}"
                f.write(f"===== {p.name}: exit {p.code()} after {secs} s\n$ {' '.join(p.cmd)}\n")
                f.write(p.text())
                f.write("\n")
            for extra in sorted(self.work.glob("*.job.log")):
                f.write(f"===== {extra.name}\n{extra.read_text(errors='replace')}\n")
            f.write("===== gate\n" + "\n".join(self.notes) + "\n")


def records(where: Proc | Path) -> list[dict]:
    """The records of a run's metrics file (a Proc's, or the file at a path); [] without one."""
    from megadyn.training.metrics_log import read_metrics

    path = where.metrics if isinstance(where, Proc) else where
    return read_metrics(path) if path is not None and path.exists() else []


def step_losses(where: Proc | Path) -> dict[int, float]:
    from megadyn.training.metrics_log import iterations

    return report.losses(iterations(records(where)))


def compare(c: Check, run: Proc, ref: Proc, iters: int, **kw) -> CheckResult:
    """`run`'s losses against `ref`'s at iterations 1..iters (after both exited)."""
    c.wait(run, ref)
    return report.compare_losses(
        c.name,
        {run.name: run.code(), ref.name: ref.code()},
        step_losses(run),
        step_losses(ref),
        iterations=list(range(kw.pop("first", 1), iters + 1)),
        tol=kw.pop("tol", BF16_LOSS_TOL),
        **kw,
    )


def elapsed() -> str:
    return f"{time.monotonic() - T0:5.0f} s"
