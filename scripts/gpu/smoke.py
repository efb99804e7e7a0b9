"""The GPU gate: every path of megadyn that only runs on GPUs, in one command on 2 GPUs.

    bash scripts/gpu/smoke.sh OUTDIR                    # all checks, the line into docs/gpu-checks.jsonl
    bash scripts/gpu/smoke.sh OUTDIR --only fp8,live_change --no-record
    SMOKE_SKIP=main_job bash scripts/gpu/smoke.sh OUTDIR   # (or SMOKE_ONLY=...)
    python3 scripts/gpu/smoke.py OUTDIR --tiny --skip main_job --jobs 1   # CPU: the flow only

Prints one markdown table (also OUTDIR/table.md), one row per check: pass/fail and its figure;
appends one JSON line (date, commit, megadyn_tree, device, checks) to docs/gpu-checks.jsonl
(also OUTDIR/record.json) unless --no-record; writes OUTDIR/<check>.log (every process of the
check: its command, exit code, seconds and output) and OUTDIR/logs.tgz with all of them (the
device machine returns 8 files: table.md, record.json and logs.tgz are enough). Exits 0 only
when every check passed. Scratch (checkpoints, metrics files, corpora) goes to --work.

Each check has its own timeout (a check over it fails with figure "timeout"; its processes,
worker trees included, are killed) and the gate a total budget (--budget-s): a check still
running at its end is stopped the same way, one not started fails with "no time". The three
checks whose figures are timings run first, one at a time, on an idle machine; the others
(losses and paths) then run --jobs at a time, sharing the GPUs.

Expected seconds on 2 x H100 (process start 15-25 s; the 1.42B model starts in ~30 s and
steps in ~0.35 s); about 5.5 minutes in all, 8 at most:
  main_job              ~50   scripts/train_default.sh --train-iters 30 (offline install, data
                              build, tp 2, 8 layers of 512)
  live_change           ~55   1.42B at dp 2, elastic_ctl: -> tp 2 at iteration 6, -> pp 2 at 14, 24 steps
  kill9_recovery        ~85   1.42B dp 2, 2 optimizer instances, 16 steps: kill -9 after 8
                              (megadyn.launch), then the same 16 steps uninterrupted
  --- then 3 at a time (~150 s for these nine) ---
  cuda_graph_tp2        ~30   eager and --enable-cuda-graph side by side, tp 2, 8 steps
  sigterm_drain         ~30   small model dp 2, SIGTERM to rank 1 after 10 of 100 steps
  cp2_a2a_docmask       ~40   cp 1 (1 GPU) beside cp 2 a2a, document masks, seq 4096, 10 steps
  cp2_p2p_docmask       ~30   cp 2 p2p (the cp 1 run shared with the check above)
  dynamic_cp_flex       ~40   --cp-placement dynamic (flex_attention) against the p2p run
  hot_switch            ~35   corpus, then static tp 2 beside --dynamic-parallelism, 6 steps
  fp8                   ~30   bf16 beside --fp8-format hybrid, tp 2 + SP, 10 steps
  save_resume_relayout  ~50   tp 2 saves at 5 of 10; pp 2 resumes from 5 (--ckpt-step 5)
  c10d_compat           ~15   python -m megadyn.core.c10d_compat (2 NCCL ranks if it takes --backend)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gate_report as report  # noqa: E402
from gate_report import BF16_LOSS_TOL, FP8_REL_TOL, CheckResult, fail  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RECORD_FILE = REPO / "docs" / "gpu-checks.jsonl"
PY = sys.executable
PORTS = {
    "live_change": 29611,
    "kill9_rdzv": 29621,
    "kill9_ctl": 29622,
    "kill9_base": 29623,
    "sigterm_drain": 29631,
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


# --- model flags ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Models:
    """pretrain_gpt.py flags of the checks' models: the 1.42B reference model
    (scripts/gpu/reference_model.sh) where the figure is a timing, small ones where the check is
    about a path; --tiny swaps them all for CPU-sized ones (a flow check on gloo)."""

    tiny: bool
    reference: list[str]
    small: list[str]
    cp: list[str]
    cp_block: int
    hot: list[str]

    @classmethod
    def make(cls, tiny: bool) -> Models:
        run = "--eval-interval 0 --num-workers 0 --hidden-dropout 0 --attention-dropout 0 --seed 1234".split()
        data = "--mock-data --tokenizer-type NullTokenizer".split()
        if tiny:
            base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256".split()
            small = (
                base + "--seq-length 128 --max-position-embeddings 128 --vocab-size 1000".split()
            )
            small += "--micro-batch-size 2 --global-batch-size 8 --lr 3e-4".split() + data + run
            reference = small + ["--use-distributed-optimizer"]
            cp = base + "--seq-length 256 --max-position-embeddings 256 --vocab-size 1000".split()
            hot = base + ["--use-distributed-optimizer"]
            block = 64
        else:
            reference = report.reference_model_flags(
                (REPO / "scripts/gpu/reference_model.sh").read_text()
            )
            base = "--num-layers 4 --hidden-size 512 --num-attention-heads 8 --bf16".split()
            small = (
                base + "--seq-length 1024 --max-position-embeddings 1024 --vocab-size 32000".split()
            )
            small += "--micro-batch-size 2 --global-batch-size 16 --lr 3e-4".split() + data + run
            cp = (
                base + "--seq-length 4096 --max-position-embeddings 4096 --vocab-size 32000".split()
            )
            hot = "--num-layers 2 --hidden-size 256 --num-attention-heads 4 --ffn-hidden-size 1024 --bf16 --use-distributed-optimizer".split()
            block = 512  # a multiple of 128: flex_attention's tiles
        cp += "--micro-batch-size 1 --global-batch-size 4 --lr 3e-4".split() + data + run
        cp += ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
        return cls(tiny, reference, small, cp, block, hot + run)


# --- the gate: checks, each with its deadline and processes ---------------------------------------
class Gate:
    def __init__(self, out: Path, work: Path, budget_s: float, models: Models, device: dict):
        self.out, self.work, self.models, self.device = out, work, models, device
        self.end = time.monotonic() + budget_s
        self.shared: dict[str, Proc] = {}
        self.lock = threading.Lock()
        self.previous_lines = RECORD_FILE.read_text().splitlines() if RECORD_FILE.exists() else []

    def run_check(self, name: str) -> CheckResult:
        fn, timeout = CHECKS[name]
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
        c.note(
            f"verdict: {'pass' if result.passed else 'FAIL'} | figure: {result.figure} | {result.reason}"
        )
        c.write_log()
        print(
            f"[{elapsed()}] {name}: {'pass' if result.passed else 'FAIL'} {report.format_figure(result.figure)} "
            f"{result.reason}",
            flush=True,
        )
        return result


class Check:
    """What one check started and when it must stop."""

    def __init__(self, gate: Gate, name: str, timeout: float):
        self.gate, self.name, self.models = gate, name, gate.models
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
        return proc

    def pretrain(self, run: str, nproc: int, flags: list[str], env: dict | None = None) -> Proc:
        """pretrain_gpt.py under torchrun --standalone, its metrics into <run>.metrics.jsonl."""
        return self.start(run, torchrun(nproc, "pretrain_gpt.py", *flags), env, metrics=True)

    def shared_pretrain(self, key: str, nproc: int, flags: list[str]) -> Proc:
        """A run that several checks compare with: started by the first that asks."""
        with self.gate.lock:
            proc = self.gate.shared.get(key)
            if proc is None:
                where = self.gate.work / "shared"
                where.mkdir(exist_ok=True)
                cmd = torchrun(nproc, "pretrain_gpt.py", *flags)
                proc = self.start(key, cmd, where=where, metrics=True)
                self.gate.shared[key] = proc
            elif proc not in self.procs:
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

    def wait_for_iteration(self, proc: Proc, n: int) -> int:
        """Until `proc`'s log shows iteration `n` or later; its iteration."""
        while True:
            it = report.last_iteration(proc.text())
            if it is not None and it >= n:
                return it
            if proc.code() is not None:
                raise RuntimeError(f"{proc.name} exited ({proc.code()}) before iteration {n}")
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


# --- the checks -----------------------------------------------------------------------------------
def check_main_job(c: Check) -> CheckResult:
    """The README's main job, 30 iterations. The machine has no network: pip's variables make
    setup_env.sh's `pip install -e .[test]` an offline install of megadyn alone."""
    from megadyn.training.metrics_log import iterations

    flags = [
        "--train-iters",
        "30",
        "--log-interval",
        "5",
        "--save",
        str(c.work / "ckpt"),
        "--save-interval",
        "30",
    ]
    if c.models.tiny:  # what the script runs after setup_env.sh (which would reinstall megadyn)
        cmd = torchrun(4, "pretrain_gpt.py", "--default-job", *flags)
    else:
        cmd = ["bash", "scripts/train_default.sh", *flags]
    env = base_env()
    env.update(PIP_NO_INDEX="1", PIP_NO_DEPS="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env["PIP_NO_BUILD_ISOLATION"] = "0"  # pip's double negative: "0" means --no-build-isolation
    proc = c.start("train_default", cmd, env, metrics=True)
    c.wait(proc)
    return report.main_job_verdict(proc.code(), iterations(records(proc)))


def check_cuda_graph(c: Check) -> CheckResult:
    flags = c.models.small + [
        "--tensor-model-parallel-size",
        "2",
        "--train-iters",
        "8",
        "--log-interval",
        "1",
    ]
    eager = c.pretrain("eager", 2, flags)
    graph = c.pretrain("graph", 2, flags + ["--enable-cuda-graph"])
    return compare(c, graph, eager, 8, exact=True)


def check_live_change(c: Check) -> CheckResult:
    port, iters = PORTS["live_change"], 24
    flags = c.models.reference + [
        "--train-iters",
        str(iters),
        "--log-interval",
        "1",
        "--elastic-control-port",
        str(port),
    ]
    job = c.pretrain("job", 2, flags)
    codes = {}
    for run, (tp, pp, at) in {"ctl_tp2": (2, 1, 6), "ctl_pp2": (1, 2, 14)}.items():
        ctl = [
            PY,
            "tools/elastic_ctl.py",
            "--port",
            str(port),
            "--timeout",
            str(int(c.left())),
            "layout",
            "--tp",
            str(tp),
            "--pp",
            str(pp),
            "--at-iteration",
            str(at),
        ]
        codes[run] = c.run(run, ctl, abort_if=lambda: job.code() is not None).code()
    c.wait(job)
    codes["job"] = job.code()
    name = c.gate.device["name"]
    previous = report.previous_check(c.gate.previous_lines, name, c.name)
    return report.live_change_verdict(
        codes, records(job), ["tp2xpp1xdp1", "tp1xpp2xdp1"], iters, previous, name
    )


def check_kill9_recovery(c: Check) -> CheckResult:
    iters, kill_after = 16, 8
    flags = c.models.reference + [
        "--num-distributed-optimizer-instances",
        "2",
        "--train-iters",
        str(iters),
        "--log-interval",
        "1",
        "--elastic-heartbeat-timeout",
        "30",
    ]
    env = base_env()
    # the README's command as it is: the launcher sets what its workers need (NCCL's async
    # error handling off, so that the survivors' abort of the communicators is theirs)
    env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    metrics = c.work / "recovery.metrics.jsonl"
    metrics.unlink(missing_ok=True)
    bench = c.run(
        "recovery",
        [
            PY,
            "tools/bench_recovery.py",
            "--in-process",
            "--nproc",
            "2",
            "--kill-after",
            str(kill_after),
            "--port",
            str(PORTS["kill9_rdzv"]),
            "--log",
            str(c.work / "recovery.job.log"),
            "--",
            *flags,
            "--elastic-control-port",
            str(PORTS["kill9_ctl"]),
            "--metrics-file",
            str(metrics),
        ],
        env,
    )
    lines = [x for x in bench.text().splitlines() if x.startswith("{")]
    result = json.loads(lines[-1]) if lines else None
    base = c.pretrain(
        "uninterrupted", 2, flags + ["--elastic-control-port", str(PORTS["kill9_base"])], env
    )
    c.wait(base)
    return report.recovery_verdict(
        result, base.code(), step_losses(metrics), step_losses(base), iters
    )


def check_sigterm_drain(c: Check) -> CheckResult:
    iters = 100
    flags = c.models.small + [
        "--train-iters",
        str(iters),
        "--log-interval",
        "1",
        "--elastic-control-port",
        str(PORTS["sigterm_drain"]),
    ]
    job = c.pretrain("job", 2, flags)
    at = c.wait_for_iteration(job, 10)
    pid = worker_pid(job.popen.pid, 1)
    if pid is None:
        return fail(c.name, "no rank 1", "found no worker with RANK=1 under torchrun")
    os.kill(pid, signal.SIGTERM)
    c.note(f"SIGTERM to rank 1 (pid {pid}) at iteration {at}")
    c.wait(job)
    return report.drain_verdict(job.code(), job.text(), records(job), iters)


CP_ITERS = 10


def cp_flags(c: Check, *extra: str) -> list[str]:
    return c.models.cp + ["--train-iters", str(CP_ITERS), "--log-interval", "1", *extra]


def cp1(c: Check) -> Proc:
    return c.shared_pretrain("cp1_docmask", 1, cp_flags(c))


def cp2_p2p(c: Check) -> Proc:
    return c.shared_pretrain(
        "cp2_p2p_docmask", 2, cp_flags(c, "--context-parallel-size", "2", "--cp-comm-type", "p2p")
    )


def check_cp2_a2a(c: Check) -> CheckResult:
    ref = cp1(c)
    a2a = c.pretrain(
        "cp2_a2a", 2, cp_flags(c, "--context-parallel-size", "2", "--cp-comm-type", "a2a")
    )
    return compare(c, a2a, ref, CP_ITERS)


def check_cp2_p2p(c: Check) -> CheckResult:
    ref = cp1(c)
    return compare(c, cp2_p2p(c), ref, CP_ITERS)


def check_dynamic_cp(c: Check) -> CheckResult:
    """Dynamic placement in 16-bit with --attention-backend auto (blocks of 128 x k tokens) is
    one flex_attention call per layer; its losses against static cp 2's (p2p)."""
    static = cp2_p2p(c)
    dynamic = c.pretrain(
        "cp2_dynamic",
        2,
        cp_flags(
            c,
            "--context-parallel-size",
            "2",
            "--cp-placement",
            "dynamic",
            "--cp-block-size",
            str(c.models.cp_block),
            "--attention-backend",
            "auto",
        ),
    )
    return compare(c, dynamic, static, CP_ITERS)


def hot_memory_gib(flags: list[str], vocab: int, seq: int, tokens: int) -> float:
    """What the length planner may use so that a dp 2 micro batch of `tokens` tokens beside a
    tp 2 copy fits, and longer samples go to tp 2 (as scripts/gpu/hot_switch.sh's TINY run)."""
    from megadyn.core.layout import Layout
    from megadyn.core.recompute import RecomputeConfig
    from megadyn.elastic.layout_planner import memory_gib
    from megadyn.models.config import GPTConfig

    value = {k: int(v) for k, v in zip(flags, flags[1:]) if k.startswith("--") and v.isdigit()}
    cfg = GPTConfig(
        num_layers=value["--num-layers"],
        hidden_size=value["--hidden-size"],
        num_attention_heads=value["--num-attention-heads"],
        ffn_hidden_size=value["--ffn-hidden-size"],
        vocab_size=vocab + 1,
        max_position_embeddings=seq,
    )
    rc = RecomputeConfig()
    return memory_gib(cfg, Layout(dp=2), 1, tokens, rc) + memory_gib(
        cfg, Layout(tp=2), 1, 0, rc, optimizer=False
    )


def check_hot_switch(c: Check) -> CheckResult:
    vocab, seq, iters = 1000, 512, 6
    prefix = c.work / "corpus"
    corpus = c.run(
        "corpus",
        [
            PY,
            "tools/make_length_corpus.py",
            "--output-prefix",
            str(prefix),
            "--vocab-size",
            str(vocab),
            "--num-documents",
            "2000",
            "--median",
            "64",
            "--sigma",
            "1.2",
            "--max-length",
            str(seq + 1),
        ],
    )
    if corpus.code() != 0:
        return fail(c.name, "no corpus", f"make_length_corpus.py exit {corpus.code()}")
    memory = hot_memory_gib(c.models.hot, vocab, seq, 300)
    c.note(f"--dynamic-parallelism-memory-gib {memory!r}: samples over ~300 tokens go to tp 2")
    flags = c.models.hot + [
        "--seq-length",
        str(seq),
        "--max-position-embeddings",
        str(seq),
        "--data-path",
        str(prefix),
        "--split",
        "100,0,0",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(vocab),
        "--sample-per-document",
        "--micro-batch-tokens",
        str(seq),
        "--global-batch-size",
        "16",
        "--lr",
        "3e-4",
        "--train-iters",
        str(iters),
        "--log-interval",
        "1",
    ]
    static = c.pretrain("static_tp2", 2, flags + ["--tensor-model-parallel-size", "2"])
    hot = c.pretrain(
        "hot",
        2,
        flags + ["--dynamic-parallelism", "--dynamic-parallelism-memory-gib", repr(memory)],
    )
    result = compare(c, hot, static, iters)
    steps = [r for r in records(hot) if r.get("record") == "dynamic_parallelism"]
    switches = sum(r.get("switches", 0) for r in steps)
    result.extra["switches"] = switches
    if result.passed and not switches:
        return fail(
            c.name,
            result.figure,
            "no switch: every sample ran under the base layout",
            **result.extra,
        )
    return result


def check_fp8(c: Check) -> CheckResult:
    iters = 10
    flags = c.models.small + [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--train-iters",
        str(iters),
        "--log-interval",
        "1",
    ]
    bf16 = c.pretrain("bf16", 2, flags)
    fp8 = c.pretrain(
        "fp8_hybrid", 2, flags + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    )
    result = compare(c, fp8, bf16, iters, tol=FP8_REL_TOL, relative=True)
    for proc in (bf16, fp8):
        steps = [r for r in records(proc) if r.get("record") == "iteration"]
        rates = sorted(r["tokens_per_sec"] for r in steps[1:] if r.get("tokens_per_sec"))
        result.extra[f"{proc.name}_tokens_per_s"] = rates[len(rates) // 2] if rates else None
    return result


def check_save_resume(c: Check) -> CheckResult:
    """Saved at tp 2 (iterations 5 and 10), resumed at pp 2 from iteration 5: the resumed
    iterations' losses against the saving run's own (it is the uninterrupted run)."""
    ckpt = c.work / "ckpt"
    flags = c.models.small + [
        "--use-distributed-optimizer",
        "--train-iters",
        "10",
        "--log-interval",
        "1",
    ]
    save = c.pretrain(
        "save_tp2",
        2,
        flags + ["--tensor-model-parallel-size", "2", "--save", str(ckpt), "--save-interval", "5"],
    )
    c.wait(save)
    if save.code() != 0:
        return fail(c.name, "run failed", f"save_tp2 exit {save.code()}")
    resume = c.pretrain(
        "resume_pp2",
        2,
        flags + ["--pipeline-model-parallel-size", "2", "--load", str(ckpt), "--ckpt-step", "5"],
    )
    result = compare(c, resume, save, 10, first=6)
    logged = sorted(step_losses(resume))
    if result.passed and logged[:1] != [6]:
        return fail(
            c.name, result.figure, f"the resumed run logged iterations {logged}", **result.extra
        )
    return result


def check_c10d_compat(c: Check) -> CheckResult:
    module = "megadyn.core.c10d_compat"
    path = REPO / "megadyn" / "core"
    if not ((path / "c10d_compat.py").exists() or (path / "c10d_compat" / "__init__.py").exists()):
        return fail(c.name, "missing", f"no {module}")
    helped = c.run("help", [PY, "-m", module, "--help"])
    backend = "gloo" if c.models.tiny else "nccl"
    if "--backend" in helped.text():
        proc = c.run(backend, torchrun(2, "-m", module, "--backend", backend))
    else:
        proc = c.run("single", [PY, "-m", module])
    out = [x for x in proc.text().splitlines() if x.strip()]
    figure = f"exit {proc.code()}, {len(out)} lines"
    extra = {"backend": proc.name}
    if proc.code() != 0:
        return fail(c.name, figure, f"{module} exit {proc.code()}", **extra)
    return CheckResult(c.name, True, figure, extra=extra)


CHECKS = {  # name: (function, timeout in seconds), in the table's order
    "main_job": (check_main_job, 180),
    "cuda_graph_tp2": (check_cuda_graph, 150),
    "live_change": (check_live_change, 180),
    "kill9_recovery": (check_kill9_recovery, 240),
    "sigterm_drain": (check_sigterm_drain, 150),
    "cp2_a2a_docmask": (check_cp2_a2a, 180),
    "cp2_p2p_docmask": (check_cp2_p2p, 180),
    "dynamic_cp_flex": (check_dynamic_cp, 180),
    "hot_switch": (check_hot_switch, 180),
    "fp8": (check_fp8, 150),
    "save_resume_relayout": (check_save_resume, 180),
    "c10d_compat": (check_c10d_compat, 90),
}
TIMED = ["main_job", "live_change", "kill9_recovery"]
"""Run first, one at a time: their figures are timings."""
POOLED = [
    "cp2_a2a_docmask",
    "cp2_p2p_docmask",
    "dynamic_cp_flex",
    "save_resume_relayout",
    "hot_switch",
    "fp8",
    "cuda_graph_tp2",
    "sigterm_drain",
    "c10d_compat",
]
"""Then --jobs at a time, longest first."""
T0 = time.monotonic()


def elapsed() -> str:
    return f"{time.monotonic() - T0:5.0f} s"


# --- where and what ------------------------------------------------------------------------------
def git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def provenance() -> dict:
    """commit and megadyn_tree: GATE_COMMIT / GATE_TREE when given, else git; a copy without
    .git gets the tree id computed from megadyn/'s files (equal to HEAD:megadyn when they are
    committed unchanged) and commit "unknown"."""
    commit = os.environ.get("GATE_COMMIT") or git("rev-parse", "HEAD") or "unknown"
    tree = os.environ.get("GATE_TREE") or git("rev-parse", "HEAD:megadyn")
    out = {"commit": commit, "megadyn_tree": tree}
    if tree is None:
        out["megadyn_tree"] = report.git_tree_hash(REPO / "megadyn")
        out["megadyn_tree_from"] = "files"
    dirty = git("status", "--porcelain", "--", "megadyn")
    if dirty:
        out["megadyn_dirty"] = True
    return out


def find_device(tiny: bool) -> dict:
    if tiny:
        return {"name": "cpu", "count": 0}
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        names = ""
    return report.device_of(names)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir", type=Path)
    p.add_argument("--only", default=os.environ.get("SMOKE_ONLY", ""), help="checks to run: a,b")
    p.add_argument("--skip", default=os.environ.get("SMOKE_SKIP", ""), help="checks to leave out")
    p.add_argument(
        "--no-record", action="store_true", help="do not append to docs/gpu-checks.jsonl"
    )
    p.add_argument("--jobs", type=int, default=3, help="checks at a time after the timed ones")
    p.add_argument("--budget-s", type=float, default=480.0, help="the whole gate's seconds")
    p.add_argument("--work", type=Path, default=Path("/tmp/megadyn_smoke"), help="scratch dir")
    p.add_argument(
        "--tiny", action="store_true", help="CPU-sized models (flow only; never recorded)"
    )
    p.add_argument("--list", action="store_true", help="print the checks and exit")
    a = p.parse_args(argv)
    if a.list:
        print("\n".join(CHECKS))
        return 0
    try:
        names = report.select_checks(list(CHECKS), a.only, a.skip)
    except ValueError as e:
        p.error(str(e))
    a.outdir.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    device = find_device(a.tiny)
    where = provenance()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    print(
        f"GPU gate: {len(names)} checks on {device['count']} x {device['name']}, "
        f"commit {where['commit'][:12]}, budget {a.budget_s:.0f} s",
        flush=True,
    )
    gate = Gate(a.outdir, a.work, a.budget_s, Models.make(a.tiny), device)
    results = {n: gate.run_check(n) for n in TIMED if n in names}
    with ThreadPoolExecutor(max(1, a.jobs)) as pool:
        pooled = {n: pool.submit(gate.run_check, n) for n in POOLED if n in names}
        results.update({n: f.result() for n, f in pooled.items()})
    ordered = [results[n] for n in names]
    table = report.render_table(ordered)
    (a.outdir / "table.md").write_text(table)
    record = report.build_record(
        ordered, date=date, device=device, seconds=round(time.monotonic() - T0), **where
    )
    line = report.record_line(record)
    (a.outdir / "record.json").write_text(line)
    with tarfile.open(a.outdir / "logs.tgz", "w:gz") as tar:
        for n in names:
            if (a.outdir / f"{n}.log").exists():
                tar.add(a.outdir / f"{n}.log", arcname=f"{n}.log")
    print("\n" + table, flush=True)
    if a.no_record or a.tiny:
        print("not recorded (--no-record or --tiny); the line is in record.json")
    else:
        with open(RECORD_FILE, "a") as f:
            f.write(line)
        print(f"appended to {RECORD_FILE.relative_to(REPO)} (also {a.outdir / 'record.json'})")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
