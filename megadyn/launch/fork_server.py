"""A pre-imported Python per host from which restarted workers fork (on under torchrun with
--max-restarts > 0; --no-elastic-fork-server turns it off).

A worker that torchrun starts again spends seconds importing torch and megadyn before it does
anything (3-8 s on the GPU machines, BENCHMARKS.md). With the fork server, local rank 0
of the first attempt (or of any attempt a host ran without one) starts one server process per
host that imports megadyn/launch/run.py (torch, megadyn, torch.distributed.checkpoint; never
CUDA) and then waits on a unix socket. A worker of a later attempt hands itself over at the
top of pretrain_gpt.py, before importing anything:

    client (the process torchrun started)          server (imports done, single-threaded)
      sends argv, environment, cwd, start time,  ->   forks a child: the environment, cwd and
      stdin/stdout/stderr and a liveness pipe          descriptors become the client's, then
                                                       megadyn.launch.run.main(argv)
      forwards SIGTERM/SIGINT to the child       <-   the child's pid
      exits with the child's status              <-   the child's exit status, once reaped

The child exits when the client dies (the liveness pipe closes), so torchrun's SIGKILL of the
client reaches it too. The server exits when the torchrun agent that started its workers does.
Without a server (the first attempt, or one not ready yet) a worker starts as usual.

The parsed config decides (`start(enabled=...)`): with --no-elastic-fork-server, local rank 0
of the first attempt leaves a marker beside the socket's path instead of a server, and the
workers of later attempts, finding it, start as usual without looking for a server.

Only the standard library is imported here at module level: the client runs before torch.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys
import threading

from megadyn.launch import torchrun_env

FORKED = "MEGADYN_FORKED"
"""Set in a forked worker's environment (it must not hand itself over again)."""
_HEADER = struct.Struct("!Q")


def socket_path() -> str | None:
    """This host's server of this torchrun agent; None outside torchrun."""
    run_id = torchrun_env.current().run_id
    if run_id is None:
        return None
    safe = "".join(c if c.isalnum() else "_" for c in run_id)[:40]
    return f"/tmp/megadyn-fork-{safe}-{os.getppid()}.sock"


# --- the client: the top of pretrain_gpt.py ------------------------------------------------
def hand_over(argv: list[str], started: float) -> None:
    """Run this worker in a child of the host's fork server and exit with its status; returns
    (having done nothing) when there is no server to hand over to."""
    path, env = socket_path(), torchrun_env.current()
    if not env.restart_count or FORKED in os.environ:
        return
    if path is not None and os.path.exists(off_marker(path)):  # --no-elastic-fork-server
        return
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except (OSError, TypeError):
        if env.rank == 0:
            print(f" fork server: none at {path}; this worker imports as usual", flush=True)
        return
    alive_read, alive_write = os.pipe()  # the child watches the read end: EOF = client gone
    request = json.dumps(
        {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "started": started}
    ).encode()
    socket.send_fds(conn, [_HEADER.pack(len(request))], [0, 1, 2, alive_read])
    conn.sendall(request)
    os.close(alive_read)
    reply = conn.makefile("r")
    child = int(json.loads(reply.readline())["pid"])

    def forward(sig, _frame):
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    status = json.loads(reply.readline() or '{"exit": 1}')
    os.close(alive_write)
    code = status["exit"]
    if code < 0:  # killed by a signal: so is this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def off_marker(path: str) -> str:
    """The file that says this agent's workers have no server (--no-elastic-fork-server)."""
    return f"{path}.off"


def job_done() -> None:
    """The job ended well: no attempt follows, the marker goes (local rank 0)."""
    path = socket_path()
    if path is not None and torchrun_env.current().local_rank == 0:
        try:
            os.unlink(off_marker(path))
        except FileNotFoundError:
            pass


# --- the server -------------------------------------------------------------------------------
def start(enabled: bool = True) -> bool:
    """Start this host's server for the agent of this worker (on local rank 0 of a worker that
    was not forked: the first attempt, or a host that had no server ready) when torchrun may
    restart it; the server serves once its imports are done. Not `enabled`
    (--no-elastic-fork-server): leave the marker that tells restarted workers not to look for
    one. Whether a server was started."""
    import subprocess

    path, env = socket_path(), torchrun_env.current()
    if path is None or env.max_restarts == 0 or env.local_rank != 0:
        return False
    if not enabled:
        open(off_marker(path), "w").close()
        return False
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.Popen(  # `-m` from the package root: this megadyn, wherever the worker's cwd is
        [sys.executable, "-m", "megadyn.launch.fork_server", path, str(os.getppid())],
        cwd=package_root,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"},
    )
    return True


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 4)
    (size,) = _HEADER.unpack(header)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("client went away")
        body += chunk
    return json.loads(body), fds


def _run_child(request: dict, fds: list[int], main) -> None:
    """In the forked child: become the client's worker and run `main` (megadyn.launch.run)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server's handler is not the worker's
    stdin, stdout, stderr, alive = fds
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"], **{FORKED: "1"})
    os.chdir(request["cwd"])
    sys.argv = [sys.argv[0], *request["argv"]]

    def watch():  # the client died (SIGKILL): so does this worker
        os.read(alive, 1)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    from megadyn.launch import errors, startup

    startup.restarted_from(request["started"])
    code = errors.run_reported(main, request["argv"])  # as pretrain_gpt.py's own __main__
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(path: str, agent: int) -> None:
    """Import the job's run, then fork a worker for each client until `agent` exits."""
    from megadyn.launch import run  # torch and megadyn; no CUDA
    from megadyn.training import checkpoint

    checkpoint.dcp()  # and the checkpoint library that megadyn imports at first use
    import torch

    if torch.cuda.is_initialized():  # a forked child could not use CUDA: serve nobody
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # still removes the socket
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.{os.getpid()}"
    listener.bind(tmp)
    listener.listen(64)
    os.replace(tmp, path)  # clients see the socket only once it accepts
    waiting: dict[int, socket.socket] = {}  # child pid -> its client
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    try:
        while _alive(agent):
            for _ in selector.select(timeout=0.2):
                conn, _ = listener.accept()
                try:
                    request, fds = _recv_request(conn)
                except (OSError, ValueError, ConnectionError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    conn.close()
                    _run_child(request, fds, run.main)
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                waiting[pid] = conn
            _reap(waiting)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _reap(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is None:
            continue
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        try:
            conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
        except OSError:
            pass  # the client is gone
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
