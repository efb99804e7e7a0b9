"""The GPU gate's checks (scripts/gpu/smoke.py runs them): each starts its runs through a
`Check` (gate_runner.py) and returns a CheckResult from gate_report.py's verdicts (gate_live_change.py's for
live_change).

A check about a path uses a small model (its cost is a process start and a few seconds); the
timed ones (live_change, kill9_recovery) use the 1.42B reference model of
scripts/gpu/reference_model.sh. Losses compared between runs are those of the same samples
(mock data and corpora are functions of the seed and the sample index).
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass

import gate_live_change as live
import gate_report as report
from gate_report import FP8_REL_TOL, CheckResult, fail
from gate_runner import (
    PORTS,
    PY,
    REPO,
    Check,
    Proc,
    base_env,
    compare,
    records,
    step_losses,
    torchrun,
    worker_pid,
)


@dataclass(frozen=True)
class Models:
    """pretrain_gpt.py flags of the checks' models: the 1.42B reference model where the figure
    is a timing, small ones where the check is about a path; --tiny swaps them all for
    CPU-sized ones (the gate's flow on gloo, no GPU)."""

    tiny: bool
    reference: list[str]
    small: list[str]
    cp: list[str]
    cp_block: int
    hot: list[str]

    @classmethod
    def make(cls, tiny: bool) -> Models:
        run = "--eval-interval 0 --num-workers 0 --hidden-dropout 0 --attention-dropout 0"
        run = f"{run} --seed 1234 --mock-data --tokenizer-type NullTokenizer".split()
        if tiny:
            base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256"
            small = f"{base} --seq-length 128 --max-position-embeddings 128 --vocab-size 1000"
            small = f"{small} --micro-batch-size 2 --global-batch-size 8 --lr 3e-4".split() + run
            reference = small + ["--use-distributed-optimizer"]
            cp = f"{base} --seq-length 256 --max-position-embeddings 256 --vocab-size 1000"
            hot = f"{base} --use-distributed-optimizer"
            block = 64
        else:
            text = (REPO / "scripts/gpu/reference_model.sh").read_text()
            reference = report.reference_model_flags(text)
            base = "--num-layers 4 --hidden-size 512 --num-attention-heads 8 --bf16"
            small = f"{base} --seq-length 1024 --max-position-embeddings 1024 --vocab-size 32000"
            small = f"{small} --micro-batch-size 2 --global-batch-size 16 --lr 3e-4".split() + run
            cp = f"{base} --seq-length 4096 --max-position-embeddings 4096 --vocab-size 32000"
            hot = "--num-layers 2 --hidden-size 256 --num-attention-heads 4 --ffn-hidden-size 1024"
            hot = f"{hot} --bf16 --use-distributed-optimizer"
            block = 512  # a multiple of 128: flex_attention's tiles
        cp = f"{cp} --micro-batch-size 1 --global-batch-size 4 --lr 3e-4".split() + run
        cp += ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
        hot = hot.split() + run[:-3]  # not --mock-data: a corpus of varied lengths
        return cls(tiny, reference, small, cp, block, hot)


def steps(iters: int, *extra: str) -> list[str]:
    return ["--train-iters", str(iters), "--log-interval", "1", *extra]


# --- the timed checks: one at a time ---------------------------------------------------------------
def check_main_job(c: Check) -> CheckResult:
    """The README's main job, 30 iterations. The machine has no network: pip's variables make
    setup_env.sh's `pip install -e .[test]` an offline install of megadyn alone."""
    from megadyn.training.metrics_log import iterations

    flags = ["--train-iters", "30", "--log-interval", "5", "--save-interval", "30"]
    flags += ["--save", str(c.work / "ckpt")]
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


def check_live_change(c: Check) -> CheckResult:
    """dp 2 -> tp 2 at iteration 6 -> pp 2 at iteration 14, asked through tools/elastic_ctl.py
    (the second request is queued behind the first; each waits for its step)."""
    port = PORTS["live_change"]
    iters = 200 if c.models.tiny else 24  # tiny steps take milliseconds
    job = c.pretrain(
        "job", 2, c.models.reference + steps(iters, "--elastic-control-port", str(port))
    )
    ctls = []
    for run, (tp, pp, at) in {"ctl_tp2": (2, 1, 6), "ctl_pp2": (1, 2, 14)}.items():
        args = f"layout --tp {tp} --pp {pp} --at-iteration {at}".split()
        ctl = c.start(run, [PY, "tools/elastic_ctl.py", "--port", str(port), "--timeout",
                            str(int(c.left())), *args])  # fmt: skip
        c.wait_for(ctl, lambda text: "submitted" in text or None, "its request's submission")
        ctls.append(ctl)
    c.wait(*ctls, abort_if=lambda: job.code() is not None)
    c.wait(job)
    codes = {p.name: p.code() for p in [*ctls, job]}
    name = c.gate.device["name"]
    previous = live.previous_check(c.gate.previous_lines, name, c.name)
    expected = ["tp2xpp1xdp1", "tp1xpp2xdp1"]
    return live.live_change_verdict(codes, records(job), expected, iters, previous, name)


RECOVERY_ITERS, KILL_AFTER = 16, 8


def recovery_flags(c: Check) -> list[str]:
    """The 1.42B reference model at dp 2 with replicated optimizer shards, 16 iterations."""
    flags = c.models.reference + ["--num-distributed-optimizer-instances", "2"]
    return flags + steps(RECOVERY_ITERS, "--elastic-heartbeat-timeout", "30")


def recovery_env() -> dict:
    # the README's command as it is: the launcher sets what its workers need (NCCL's async
    # error handling off, so that the survivors' abort of the communicators is theirs)
    env = base_env()
    env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    return env


def uninterrupted(c: Check) -> Proc:
    """The run kill9_recovery and lost_host compare their losses with (started once)."""
    ctl = ["--elastic-control-port", str(PORTS["kill9_base"])]
    return c.shared_pretrain("recovery_uninterrupted", 2, recovery_flags(c) + ctl)


def recovery_result(c: Check, run: str, cmd: list[str], name: str, max_s: float) -> CheckResult:
    """Run the timing script `cmd` (its last output line is its JSON result, its job's
    metrics in <run>.metrics.jsonl) and judge it against the uninterrupted run."""
    metrics = c.work / f"{run}.metrics.jsonl"
    metrics.unlink(missing_ok=True)
    proc = c.run(run, [*cmd, "--metrics-file", str(metrics)], recovery_env())
    lines = [x for x in proc.text().splitlines() if x.startswith("{")]
    result = json.loads(lines[-1]) if lines else None
    base = uninterrupted(c)
    c.wait(base)
    return report.recovery_verdict(
        result, base.code(), step_losses(metrics), step_losses(base), RECOVERY_ITERS,
        max_kill_to_step_s=max_s, name=name,
    )  # fmt: skip


def check_kill9_recovery(c: Check) -> CheckResult:
    """kill -9 of rank 1 after iteration 8 under `python -m megadyn.launch` (in-process
    recovery, tools/bench_recovery.py), then the same 16 iterations uninterrupted."""
    bench = [PY, "tools/bench_recovery.py", "--in-process", "--nproc", "2", "--kill-after",
             str(KILL_AFTER), "--port", str(PORTS["kill9_rdzv"]), "--log",
             str(c.work / "recovery.job.log"), "--", *recovery_flags(c),
             "--elastic-control-port", str(PORTS["kill9_ctl"])]  # fmt: skip
    return recovery_result(c, "recovery", bench, c.name, 3.0)


def check_lost_host(c: Check) -> CheckResult:
    """The host of rank 0 lost after iteration 8: 2 GPUs as 2 hosts (one `python -m
    megadyn.launch --coordinator` agent per GPU, the coordinator a third process); its agent
    and worker SIGKILLed together (scripts/gpu/lost_host.py); the survivor's losses against
    kill9_recovery's uninterrupted run."""
    script = [PY, "scripts/gpu/lost_host.py", "--hosts", "2", "--nproc-per-host", "1",
              "--gpus", "" if c.models.tiny else "0,1", "--kill-after", str(KILL_AFTER),
              "--log", str(c.work / "lost_host.job.log"), "--", *recovery_flags(c),
              "--elastic-control-port", str(PORTS["lost_host_ctl"])]  # fmt: skip
    return recovery_result(c, "lost_host", script, c.name, 5.0)


# --- the others: --jobs at a time ------------------------------------------------------------------
def check_cuda_graph(c: Check) -> CheckResult:
    # tp 2 + SP with the distributed optimizer (one GPU: tp 1), under --deterministic-mode:
    # without it the attention backward's atomics make two eager runs differ in the last bits
    # (4e-5 by step 8), and the check would compare run-to-run noise instead of the graph
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layout = tp2 if c.width == 2 else []
    flags = c.models.small + steps(
        8, *layout, "--use-distributed-optimizer", "--deterministic-mode"
    )
    eager = c.pretrain("eager", c.width, flags)
    graph = c.pretrain("graph", c.width, flags + ["--enable-cuda-graph"])
    return compare(c, graph, eager, 8, exact=True)


def check_sigterm_drain(c: Check) -> CheckResult:
    """SIGTERM to rank 1 of an elastic dp 2 job at iteration 10 of 100 (docs/elastic.md: a preemption
    notice drains a worker)."""
    iters = 100
    port = str(PORTS["sigterm_drain"])
    job = c.pretrain("job", 2, c.models.small + steps(iters, "--elastic-control-port", port))
    c.wait_for(job, lambda text: (report.last_iteration(text) or 0) >= 10 or None, "step 10")
    pid = worker_pid(job.popen.pid, 1)
    if pid is None:
        return fail(c.name, "no rank 1", "found no worker with RANK=1 under torchrun")
    os.kill(pid, signal.SIGTERM)
    c.note(f"SIGTERM to rank 1 (pid {pid}) after iteration {report.last_iteration(job.text())}")
    c.wait(job)
    return report.drain_verdict(job.code(), job.text(), records(job), iters)


CP_ITERS = 10


def cp1(c: Check) -> Proc:
    return c.shared_pretrain("cp1_docmask", 1, c.models.cp + steps(CP_ITERS))


def cp2(c: Check, *flags: str) -> list[str]:
    return c.models.cp + steps(CP_ITERS, "--context-parallel-size", "2", *flags)


def cp2_p2p(c: Check) -> Proc:
    return c.shared_pretrain("cp2_p2p_docmask", 2, cp2(c, "--cp-comm-type", "p2p"))


def check_cp2_a2a(c: Check) -> CheckResult:
    ref = cp1(c)
    return compare(c, c.pretrain("cp2_a2a", 2, cp2(c, "--cp-comm-type", "a2a")), ref, CP_ITERS)


def check_cp2_p2p(c: Check) -> CheckResult:
    ref = cp1(c)
    return compare(c, cp2_p2p(c), ref, CP_ITERS)


def check_dynamic_cp(c: Check) -> CheckResult:
    """Dynamic placement in 16-bit with --attention-backend auto (blocks a multiple of 128
    tokens) is one flex_attention call per layer; its losses against static cp 2's (p2p)."""
    static = cp2_p2p(c)
    flags = cp2(c, "--cp-placement", "dynamic", "--cp-block-size", str(c.models.cp_block))
    dynamic = c.pretrain("cp2_dynamic", 2, flags + ["--attention-backend", "auto"])
    return compare(c, dynamic, static, CP_ITERS)


def hot_memory_gib(flags: list[str], vocab: int, seq: int, gbs: int) -> tuple[float, str]:
    """A --dynamic-parallelism-memory-gib under which the length planner (the job's own,
    megadyn/elastic/planning/lengths.py) sends short samples to dp 2 and long ones to tp 2:
    the middle of the memory range where its plan has both groups (below it some length fits
    no layout, above it dp 2 holds them all); and the plan's groups."""
    from megadyn.core.layout import Layout, LayoutError
    from megadyn.elastic.planning.lengths import plan_length_groups
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

    def groups(gib: float):
        plan = plan_length_groups(cfg, Layout(dp=2), budget=seq, seq_length=seq,
                                  global_batch_size=gbs, gpu_memory_gib=gib)  # fmt: skip
        return plan.groups

    def fits(gib: float) -> bool:
        try:
            groups(gib)
        except LayoutError:
            return False
        return True

    def lowest(ok, hi: float = 64.0) -> float:  # the least memory where ok() holds (monotone)
        lo = 0.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return hi

    least = lowest(fits)
    dp2_alone = lowest(lambda gib: fits(gib) and len(groups(gib)) == 1)
    gib = (least + dp2_alone) / 2
    return gib, "; ".join(f"{g.layout.tp}x{g.layout.dp}: {g.lengths}" for g in groups(gib))


def check_hot_switch(c: Check) -> CheckResult:
    """--dynamic-parallelism (base dp 2, the longest samples under tp 2) against static
    tp 2 on a corpus of log-normal lengths (scripts/gpu/hot_switch.sh, small)."""
    # a vocabulary of 32000: its logits, split over tp, are what tp 2 saves for long samples
    vocab, seq, iters = 1000 if c.models.tiny else 32000, 512, 6
    prefix = c.work / "corpus"
    shape = (
        f"--vocab-size {vocab} --num-documents 2000 --median 64 --sigma 1.2 --max-length {seq + 1}"
    )
    make = [PY, "tools/make_length_corpus.py", "--output-prefix", str(prefix), *shape.split()]
    corpus = c.run("corpus", make)
    if corpus.code() != 0:
        return fail(c.name, "no corpus", f"make_length_corpus.py exit {corpus.code()}")
    memory, plan = hot_memory_gib(c.models.hot, vocab, seq, gbs=16)
    c.note(f"--dynamic-parallelism-memory-gib {memory!r}: the planner's groups (tp x dp) {plan}")
    data = (
        f"--seq-length {seq} --max-position-embeddings {seq} --split 100,0,0 --vocab-size {vocab}"
    )
    data += f" --tokenizer-type NullTokenizer --sample-per-document --micro-batch-tokens {seq}"
    data += " --global-batch-size 16 --lr 3e-4"
    flags = c.models.hot + data.split() + ["--data-path", str(prefix)] + steps(iters)
    static = c.pretrain("static_tp2", 2, flags + ["--tensor-model-parallel-size", "2"])
    hot = ["--dynamic-parallelism", "--dynamic-parallelism-memory-gib", repr(memory)]
    hot = c.pretrain("hot", 2, flags + hot)
    result = compare(c, hot, static, iters)
    switches = sum(
        r.get("switches", 0) for r in records(hot) if r["record"] == "dynamic_parallelism"
    )
    result.extra["switches"] = switches
    if result.passed and not switches:
        reason = "no switch: every sample ran under the base layout"
        return fail(c.name, result.figure, reason, **result.extra)
    return result


def check_fp8(c: Check) -> CheckResult:
    """FP8 (hybrid, tensorwise) at tp 2 + SP (one GPU: tp 1) against bf16: finite, within
    FP8_REL_TOL."""
    iters = 10
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"] if c.width == 2 else []
    flags = c.models.small + steps(iters, *layout)
    bf16 = c.pretrain("bf16", c.width, flags)
    fp8 = "--fp8-format hybrid --fp8-recipe tensorwise".split()
    fp8 = c.pretrain("fp8_hybrid", c.width, flags + fp8)
    result = compare(c, fp8, bf16, iters, tol=FP8_REL_TOL, relative=True)
    for proc in (bf16, fp8):
        logged = [r for r in records(proc) if r["record"] == "iteration"]
        rates = sorted(r["tokens_per_sec"] for r in logged[1:] if r.get("tokens_per_sec"))
        result.extra[f"{proc.name}_tokens_per_s"] = rates[len(rates) // 2] if rates else None
    return result


def check_save_resume(c: Check) -> CheckResult:
    """Saved at tp 2 (iterations 5 and 10), resumed at pp 2 from iteration 5 (--ckpt-step 5):
    the resumed iterations' losses against the saving run's own, the uninterrupted run. (One
    GPU: saved and resumed on it.)"""
    ckpt = str(c.work / "ckpt")
    flags = c.models.small + steps(10, "--use-distributed-optimizer")
    two = c.width == 2
    save = ["--save", ckpt, "--save-interval", "5"]
    save = c.pretrain("save_tp2" if two else "save", c.width,
                      flags + save + (["--tensor-model-parallel-size", "2"] if two else []))  # fmt: skip
    c.wait(save)
    if save.code() != 0:
        return fail(c.name, "run failed", f"{save.name} exit {save.code()}")
    load = ["--load", ckpt, "--ckpt-step", "5"]
    load += ["--pipeline-model-parallel-size", "2"] if two else []
    resume = c.pretrain("resume_pp2" if two else "resume", c.width, flags + load)
    result = compare(c, resume, save, 10, first=6)
    logged = sorted(step_losses(resume))
    if result.passed and logged[:1] != [6]:
        reason = f"the resumed run logged iterations {logged}"
        return fail(c.name, result.figure, reason, **result.extra)
    return result


def check_c10d_compat(c: Check) -> CheckResult:
    """megadyn.core.c10d_compat's self-check of torch's private c10d parts: on 2 NCCL ranks
    when it takes --backend, else in one process."""
    module = "megadyn.core.c10d_compat"
    path = REPO / "megadyn" / "core"
    if not ((path / "c10d_compat.py").exists() or (path / "c10d_compat" / "__init__.py").exists()):
        return fail(c.name, "missing", f"no {module}")
    helped = c.run("help", [PY, "-m", module, "--help"])
    backend = "gloo" if c.models.tiny else "nccl"
    if "--backend" in helped.text():
        proc = c.run(backend, torchrun(c.width, "-m", module, "--backend", backend))
    else:
        proc = c.run("single", [PY, "-m", module])
    lines = [x for x in proc.text().splitlines() if x.strip()]
    figure = f"exit {proc.code()}, {len(lines)} lines"
    if proc.code() != 0:
        return fail(c.name, figure, f"{module} exit {proc.code()}", backend=proc.name)
    return CheckResult(c.name, True, figure, extra={"backend": proc.name})


CHECKS = {  # name: (function, timeout in seconds), in the table's order
    "main_job": (check_main_job, 180),
    "cuda_graph_tp2": (check_cuda_graph, 150),
    "live_change": (check_live_change, 180),
    "kill9_recovery": (check_kill9_recovery, 240),
    "lost_host": (check_lost_host, 150),
    "sigterm_drain": (check_sigterm_drain, 150),
    "cp2_a2a_docmask": (check_cp2_a2a, 180),
    "cp2_p2p_docmask": (check_cp2_p2p, 180),
    "dynamic_cp_flex": (check_dynamic_cp, 180),
    "hot_switch": (check_hot_switch, 180),
    "fp8": (check_fp8, 150),
    "save_resume_relayout": (check_save_resume, 180),
    "c10d_compat": (check_c10d_compat, 90),
}
TWO_GPUS = {"live_change", "kill9_recovery", "lost_host", "sigterm_drain", "cp2_a2a_docmask",
            "cp2_p2p_docmask", "dynamic_cp_flex", "hot_switch"}  # fmt: skip
"""Checks that need 2 GPUs; on one GPU the others run at width 1 (tp 1, the same flags
otherwise) and these are reported as not run. (NCCL takes one rank per GPU.)"""
ONE_GPU_NAMES = {"cuda_graph_tp2": "cuda_graph_1gpu", "fp8": "fp8_1gpu",
                 "save_resume_relayout": "save_resume_1gpu"}  # fmt: skip
"""The names those checks take at width 1."""
TIMED = ["main_job", "live_change", "kill9_recovery", "lost_host"]
"""Run first, one at a time, on an idle machine: their figures are timings."""
POOLED = ["cp2_a2a_docmask", "cp2_p2p_docmask", "dynamic_cp_flex", "save_resume_relayout",
          "hot_switch", "fp8", "cuda_graph_tp2", "sigterm_drain", "c10d_compat"]  # fmt: skip
"""Then --jobs at a time, the longest first."""
