"""`python -m megadyn.launch --replace-lost-host`: the agent of a host that takes a lost host's
place in a running job (rejoin.py).

    python -m megadyn.launch --coordinator COORD:29400 --nnodes 2 --nproc-per-node 8 \\
        --rdzv-id job1 --replace-lost-host pretrain_gpt.py <the job's flags>

It does not enter torchrun's rendezvous: the survivors' agents keep their workers. It claims
a lost host's slot in the coordinator's store (`rejoin.claim`; it waits up to
`--replace-wait` seconds for one; the job's world size is read from its workers' heartbeats,
so --nnodes may be a range), starts that slot's workers with torchrun's environment
(the lost host's global ranks, the job's world size, the coordinator's store) and
MEGADYN_REJOIN=k, then does what a survivor-keeping agent does for them: its keep-alive under
the slot (hosts.HostWatch, fenced for rejoin epoch k only: the lost processes stay fenced),
the other hosts watched, a worker's failure recorded for the survivors (failures.py). It ends
when its workers have: 0 when the last ones exited 0, 1 otherwise, 3 when fenced.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from megadyn.launch import failures, hosts, rejoin, torchrun_env
from megadyn.launch.console import print_line
from megadyn.launch.distributed_init import attempt_prefix
from megadyn.launch.store_client import ReconnectingStore, probe
from megadyn.launch.watchdog import attempt_world

FENCED_EXIT = 3
MONITOR_S = 0.1


def coordinator_answers(coordinator: tuple[str, int], wait_s: float) -> bool:
    """Whether `coordinator` accepts a TCP connection within `wait_s` seconds (a plain
    connect, so an address with no server costs no store client's error log)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            probe(coordinator, 1.0)
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)


def running_attempt(client, max_restarts: int) -> int:
    """The newest attempt whose workers recover in-process (the one running)."""
    for attempt in range(max_restarts, -1, -1):
        if failures.recovering(dist.PrefixStore(attempt_prefix(attempt), client)):
            return attempt
    return 0


def worker_env(args, slot: rejoin.Slot, local_rank: int, attempt: int, coordinator) -> dict:
    """torchrun's environment of the slot's worker `local_rank`, and the rejoin epoch."""
    nproc, nnodes = len(slot.ranks), slot.nnodes
    env = dict(os.environ)
    env.update(
        RANK=str(slot.ranks[local_rank]),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nproc * nnodes),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK=str(slot.group_rank),
        GROUP_WORLD_SIZE=str(nnodes),
        ROLE_RANK=str(slot.ranks[local_rank]),
        ROLE_WORLD_SIZE=str(nproc * nnodes),
        ROLE_NAME="default",
        MASTER_ADDR=coordinator[0],
        MASTER_PORT=str(coordinator[1]),
        TORCHELASTIC_RESTART_COUNT=str(attempt),
        TORCHELASTIC_MAX_RESTARTS=str(args.max_restarts),
        TORCHELASTIC_RUN_ID=args.rdzv_id,
        TORCHELASTIC_USE_AGENT_STORE="True",
        MEGADYN_KEEP_SURVIVORS="1",
        **{torchrun_env.COORDINATOR_ENV: "1", rejoin.REJOIN_ENV: str(slot.epoch)},
    )
    return env


def replace(args, host_timeout_s: float, coordinator: tuple[str, int], wait_s: float) -> int:
    """Claim a lost host's slot and run its workers until they end (module docstring)."""
    nproc = int(args.nproc_per_node)
    if not coordinator_answers(coordinator, wait_s):  # nothing to claim without it
        host, port = coordinator
        print_line(
            f"megadyn.launch: --replace-lost-host: no coordinator answered at {host}:{port} "
            f"(--coordinator) within --replace-wait {wait_s:g} s; a replacement host joins a "
            "running job through the coordinator its hosts were started with"
        )
        return 2
    client = ReconnectingStore(*coordinator, timedelta(seconds=30))
    attempt = running_attempt(client, args.max_restarts)
    store = dist.PrefixStore(attempt_prefix(attempt), client)
    me = torchrun_env.host_identity()
    deadline = time.monotonic() + wait_s
    slot = None
    while slot is None:
        world = attempt_world(client, attempt)  # the job's hosts: --nnodes may be a range
        if world is not None and world % nproc == 0:
            slot = rejoin.claim(store, world // nproc, nproc, me)
        if slot is None and time.monotonic() > deadline:
            print_line(
                f"megadyn.launch: no lost host of {nproc} workers to replace within {wait_s:g} s "
                f"(the running job's world size: {world})"
            )
            return 2
        time.sleep(0 if slot is not None else 0.5)
    print_line(
        f"megadyn.launch: host {me} replaces lost node rank {slot.group_rank}: ranks "
        f"{list(slot.ranks)} start in rejoin epoch {slot.epoch} and join the job at a step "
        "boundary"
    )
    cmd = [sys.executable, "-u", args.training_script, *args.training_script_args]
    procs = {
        slot.ranks[lr]: subprocess.Popen(cmd, env=worker_env(args, slot, lr, attempt, coordinator))
        for lr in range(nproc)
    }
    watch = hosts.HostWatch(
        store,
        slot.group_rank,
        me,
        {rank: p.pid for rank, p in procs.items()},
        host_timeout_s,
        log=print_line,
        incarnation=slot.epoch,
    )
    return _monitor(store, slot, procs, watch, me)


def _monitor(store, slot: rejoin.Slot, procs: dict, watch: hosts.HostWatch, me: str) -> int:
    """Watch the workers until they end; record each failure for the survivors."""
    exits: dict[int, int] = {}
    recorded: set[int] = set()
    while True:
        for rank, p in procs.items():
            code = p.poll()
            if code is None or rank in exits:
                continue
            exits[rank] = code
            running = [r for r, q in procs.items() if q.poll() is None]
            if code != 0 and running:  # the others go on: a survivors' recovery
                local = slot.ranks.index(rank)
                record = failures.WorkerFailure(
                    rank, local, slot.group_rank, me, p.pid, code, time.time()
                )
                failures.record(store, record)
                recorded.add(rank)
                print_line(f"megadyn.launch: {record.describe()}; recorded for the survivors")
        alive = {r for r, p in procs.items() if p.poll() is None}
        try:
            watch.tick(slot.nnodes, alive)
        except hosts.Fenced as e:
            print_line(f"megadyn.launch: this host was declared lost: {e}; its workers stop")
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
            return FENCED_EXIT
        except Exception:  # noqa: BLE001 - the coordinator is away: the workers go on
            pass
        if not alive:
            break
        time.sleep(MONITOR_S)
    watch.leave()
    last = [code for rank, code in exits.items() if rank not in recorded]
    return 0 if all(code == 0 for code in last) else 1
