"""`python -m megadyn.launch` (megadyn/launch/agent.py): torchrun's launcher whose agent keeps
survivors. Real launchers and gloo workers (tests/launch/survivor_worker.py): a worker
SIGKILLed after a barrier leaves the others running, they read who died from the agent's store
and finish, and the job exits 0 (on one host, and with two agents); with the behaviour off, or workers that never said they
recover, the agent stops them as torchrun does; survivors that give up too take torchrun's
restart path. One poll of the workers decides a monitor tick: a worker killed during the
agent's store work is kept when the workers recover in-process, torchrun's failure when they
do not. pretrain_gpt.py trains under the launcher with torchrun's losses."""

import os
import re
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

from megadyn.launch import failures
from megadyn.launch.__main__ import parse_args, set_worker_environment
from megadyn.launch.agent import SurvivorKeepingAgent
from megadyn.testing import free_port
from tests.tiny import RUN, tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = "tests/launch/survivor_worker.py"
TINY = tiny_args(RUN, make_vocab_size_divisible_by=8, train_iters=5, use_distributed_optimizer=True)


def start(module: str, args: list[str], nproc: int = 3, **env_overrides) -> subprocess.Popen:
    """Start `python -m <module> --nproc-per-node <nproc> <args>` from the repository root (the
    workers import this checkout's megadyn)."""
    cmd = [sys.executable, "-m", module, "--nproc-per-node", str(nproc), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env_overrides)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    env.pop("MEGADYN_KEEP_SURVIVORS", None)
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env_overrides:
        env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(job: subprocess.Popen) -> tuple[int, str]:
    """The exit status and output of a job from `start`."""
    try:
        out, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    print(out)
    return job.returncode, out


def launch(module: str, args: list[str], nproc: int = 3, **env) -> tuple[int, str]:
    """Run a launcher of one host on a free port; its exit status and output."""
    return finish(start(module, ["--master-port", str(free_port()), *args], nproc, **env))


def test_survivors_finish_and_the_job_succeeds():
    code, out = launch("megadyn.launch", [WORKER])
    assert code == 0, out
    # the launcher gives its workers what the recovery needs of NCCL (the README's command)
    assert out.count("keep_survivors=True, TORCH_NCCL_ASYNC_ERROR_HANDLING=0") == 3, out
    assert "set by you" not in out, out
    kept = re.findall(r"megadyn\.launch: rank 1 \(local rank 1 on \S+, pid \d+\) killed by SIGKILL;"
                      r" 2 worker\(s\) of this agent keep running \(recorded under "
                      r"megadyn/attempt_0/failed/1 in the agent's store\)", out)  # fmt: skip
    assert len(kept) == 1, out
    for rank in (0, 2):
        assert re.search(
            rf"worker {rank}: the agent's store says: rank 1 .* killed by SIGKILL", out
        )
        assert f"worker {rank}: done, sum 2" in out, out
    assert "failures survived: rank 1 (local rank 1 on " in out, out
    assert "ChildFailedError" not in out and "Root Cause" not in out, out


def test_the_agent_of_another_host_sees_the_record():
    """Two agents (hosts) of one job, ranks 0-1 and 2: rank 1's agent records its death where
    rank 2, on the other agent, reads it; both agents end well."""
    rdzv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-id", "two-hosts"]
    rdzv += ["--rdzv-endpoint", f"localhost:{free_port()}"]
    jobs = [start("megadyn.launch", [*rdzv, WORKER], nproc=n) for n in (2, 1)]
    (code_a, out_a), (code_b, out_b) = [finish(job) for job in jobs]
    assert code_a == 0 and code_b == 0, out_a + out_b
    assert "rank 1 (local rank 1 on" in out_a and "keep running" in out_a, out_a
    assert re.search(r"worker 2: the agent's store says: rank 1 .* killed by SIGKILL", out_b)
    assert "worker 2: done, sum 2" in out_b and "keep running" not in out_b, out_b


@pytest.mark.parametrize("how", ["--no-keep-survivors", "--no-declare"])
def test_without_in_process_recovery_the_agent_stops_the_others(how):
    """Survivors not kept (the flag), or kept by nobody's request (the workers never declared
    that they recover): torchrun's path, the others stopped and the job failed."""
    flags, worker_flags = ([how], []) if how.startswith("--no-keep") else ([], [how])
    code, out = launch("megadyn.launch", [*flags, WORKER, *worker_flags])
    assert code != 0, out
    assert out.count(f"keep_survivors={how == '--no-declare'}") == 3, out
    assert "keep running" not in out and "done, sum" not in out, out
    assert re.search(r"Sending process \d+ closing signal SIGTERM", out), out
    assert "exitcode  : -9" in out.split("Root Cause")[1], out


def test_survivors_that_give_up_take_the_restart_path():
    code, out = launch("megadyn.launch", ["--max-restarts", "1", WORKER, "--survivors-fail"])
    assert code == 0, out
    assert "keep running" in out and "the survivors failed too" in out, out
    assert out.count("attempt 1, keep_survivors=True") == 3, out
    assert all(f"worker {r}: done, sum 3" in out for r in range(3)), out


@pytest.mark.parametrize("recovering", [True, False])
def test_one_poll_decides(recovering, tmp_path, monkeypatch):
    """Worker 1 runs at the agent's poll and is SIGKILLed during its store work (the host watch).
    Workers that recover in-process: the agent's tick says HEALTHY from its own poll (torchrun's
    monitor, polling again, would stop worker 0), and the next tick keeps and records the
    failure. Workers that never said so: torchrun's decision, worker 0 stopped."""
    wait = f"import os, time\nwhile not os.path.exists({str(tmp_path / 'go')!r}): time.sleep(0.01)"
    procs = start_processes(
        "poll",
        sys.executable,
        {lr: ("-c", wait) for lr in range(2)},
        {lr: {} for lr in range(2)},
        DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
    )
    rdzv = SimpleNamespace(use_agent_store=False)
    spec = WorkerSpec("trainer", 2, rdzv, entrypoint=sys.executable, max_restarts=0)
    agent = SurvivorKeepingAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path / "agent")))
    group = agent._worker_group
    monkeypatch.setattr(
        LocalElasticAgent, "_start_workers", lambda self, g: setattr(self, "_pcontext", procs)
    )
    try:
        agent._start_workers(group)
        for w in group.workers:
            w.id, w.global_rank = procs.pids()[w.local_rank], w.local_rank
        store = dist.HashStore()
        agent._records, agent._recovering = (store, True) if recovering else (None, False)
        handlers = procs.subprocess_handlers

        def kill_worker_1(worker_group, running):
            if running == [0, 1]:
                os.kill(handlers[1].proc.pid, signal.SIGKILL)
                handlers[1].proc.wait()

        monkeypatch.setattr(agent, "_watch_hosts", kill_worker_1)
        result = agent._monitor_workers(group)
        if not recovering:  # torchrun's: the failure, the other worker stopped
            assert result.state == WorkerState.FAILED, result
            assert result.failures[1].exitcode == -signal.SIGKILL
            assert handlers[0].proc.poll() is not None
            return
        assert result.state == WorkerState.HEALTHY and handlers[0].proc.poll() is None
        assert agent._monitor_workers(group).state == WorkerState.HEALTHY  # the next tick
        assert agent._kept[1].exitcode == -signal.SIGKILL and handlers[0].proc.poll() is None
        assert failures.read(store, 2)[1].describe().endswith("killed by SIGKILL")
        (tmp_path / "go").touch()  # worker 0 finishes: the group succeeded
        assert handlers[0].proc.wait(timeout=10) == 0
        assert agent._monitor_workers(group).state == WorkerState.SUCCEEDED
    finally:
        procs.close()


def test_failure_records_through_a_store():
    store = dist.HashStore()
    assert not failures.recovering(store) and failures.wait_for(store, 4, timeout=0.05) == {}
    failures.declare_recovering(store)
    died = failures.WorkerFailure(1, 1, 0, "host", 123, -signal.SIGKILL, 10.0)
    failures.record(store, died)
    assert failures.recovering(store) and failures.wait_for(store, 4, timeout=1) == {1: died}
    assert died.describe() == "rank 1 (local rank 1 on host, pid 123) killed by SIGKILL"
    assert failures.wait_for(store, 4, timeout=0.05, seen=1) == {}  # no second one
    assert "exited with 3" in failures.WorkerFailure(2, 0, 1, "h", 9, 3, 0.0).describe()


def test_off_by_flag_or_environment(monkeypatch):
    monkeypatch.delenv("MEGADYN_KEEP_SURVIVORS", raising=False)
    args, keep = parse_args(["--nproc-per-node", "2", "train.py", "--lr", "1"])
    assert keep and args.nproc_per_node == "2" and args.training_script_args == ["--lr", "1"]
    assert not parse_args(["--no-keep-survivors", "train.py"])[1]
    monkeypatch.setenv("MEGADYN_KEEP_SURVIVORS", "0")
    assert not parse_args(["train.py"])[1]


def test_a_users_nccl_setting_is_kept_with_its_cost_said():
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    (line,) = set_worker_environment(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (set by you)" in line and "restart path" in line
    assert set_worker_environment({}) == []


def test_pretrain_gpt_trains_as_under_torchrun():
    losses = {}
    for module in ("megadyn.launch", "torch.distributed.run"):
        code, out = launch(module, ["pretrain_gpt.py", *TINY], nproc=2)
        assert code == 0, out
        losses[module] = re.findall(r"iteration\s+\d+/\s+5 .*? lm loss: (\S+)", out)
    assert len(losses["megadyn.launch"]) == 5, losses
    assert losses["megadyn.launch"] == losses["torch.distributed.run"]
