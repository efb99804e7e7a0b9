"""Run a function in N spawned processes joined by a gloo process group on a free port.

    def body(rank, world, tp):
        ...                               # torch.distributed is initialized here
    spawn(body, world=4, args=(2,))       # raises if any rank raised, with its traceback

The function must be importable (defined at module level of a test module).  Results that a
rank returns come back as a list indexed by rank.

The processes are forked from one server process per test session that has imported torch
(multiprocessing's forkserver): a fresh interpreter per rank would import torch again, which
costs seconds of CPU per job on a loaded machine. Each rank starts with the environment,
working directory, stdout and stderr the caller has at the call (pytest's capture included), as
a freshly spawned process would.
"""

from __future__ import annotations

import os
import queue as queue_module
import random
import socket
import time
import traceback
from datetime import timedelta
from multiprocessing import reduction

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port that nothing listens on, below the kernel's ephemeral range where it has one
    below it: torchrun and gloo bind port 0 (an ephemeral port) while a test's job runs, and a
    port the test chose there could be handed to them before the job binds it. A port is
    handed out once per process."""
    low, rng = _ephemeral_low(), random.SystemRandom()
    for _ in range(200 if low > 11000 else 0):  # else no room below it: the kernel's choice
        port = rng.randrange(10000, low)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


_PRELOAD = ("torch", "torch.distributed")  # what the server imports once for every rank


class _CallerFd:
    """A file descriptor of the caller, sent to the rank when the process starts (a forked
    rank would otherwise hold the server's)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):  # pickled while the process starts: the fd travels with it
        return (_received_fd, (reduction.DupFd(self.fd),))


def _received_fd(dup) -> int:
    return dup.detach()


def _worker(rank, world, port, fn, args, queue, timeout_s, caller):
    env, cwd, stdout, stderr = caller  # the caller's, not the server's
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, target in ((stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - forwarded to the parent with the traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world: int, args: tuple = (), timeout_s: float = 300.0) -> list:
    """Run `fn(rank, world, *args)` on `world` processes; return each rank's result."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first job)
    queue = ctx.Queue()
    port = free_port()
    caller = (dict(os.environ), os.getcwd(), _CallerFd(1), _CallerFd(2))
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, fn, args, queue, timeout_s, caller))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    deadline = time.monotonic() + timeout_s + 15
    while len(results) < world and not errors:
        try:
            rank, status, payload = queue.get(timeout=1.0)
        except queue_module.Empty:
            dead = [
                r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results
            ]
            if dead:
                errors.append(f"ranks {dead} exited with codes {[procs[r].exitcode for r in dead]}")
            elif time.monotonic() > deadline:
                errors.append(
                    f"timed out after {timeout_s:.0f}s; finished ranks: {sorted(results)}"
                )
            continue
        if status == "ok":
            results[rank] = payload
        else:
            errors.append(f"--- rank {rank} ---\n{payload}")
    if errors:
        for p in procs:
            p.kill()
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("a spawned rank failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]
