"""`python -m megadyn.launch.coordinator`: the job's store, on a host that does not train.

    python -m megadyn.launch.coordinator --port 29400            # on the coordinator host
    python -m megadyn.launch --nnodes 2 --nproc-per-node 8 --coordinator COORDINATOR:29400 \\
        --rdzv-id job1 --max-restarts 0 pretrain_gpt.py ...      # on every training host

torchrun's c10d rendezvous keeps its state in a TCPStore served by one of the agents (the one
on the endpoint's host), and the workers' default store, megadyn's failure records and the
agents' keep-alives (hosts.py) live in that same store. Served by a training host, they go with
it. This process serves that store on its own, so a lost training host, whichever it is, takes
none of them along: the survivors read the lost host's failure records and recover in-process.
It is torch's TCPStore server and nothing else; it holds no training state and can run on any
small machine (a login node, a Kubernetes service). `--coordinator HOST:PORT` is torchrun's
c10d rendezvous at HOST:PORT, every agent a client (`--rdzv-backend megadyn`: rendezvous.py),
and points the workers' MASTER_ADDR and MASTER_PORT at the same store (agent.py).

The coordinator may itself stop and be started again at the same address (a pod rescheduled
onto the same service, a restarted process); the job trains on. While it is down the
collectives do not need it: no worker is ended for the silence (watchdog.py), no host is
declared lost (hosts.py), the agents' loops and torchrun's rendezvous keep-alive go on, each
process says so in one line. When it is back, its store is empty: every agent and worker
connects again (store_client.py), publishes what it keeps there (heartbeats, keep-alives,
failure records, the rendezvous state), says so in one line, and failures are handled
in-process again. What needs the store meanwhile (a failure, a live layout change's group
creation) waits for it within its own timeouts; a failure the survivors cannot handle in that
time takes torchrun's restart path, which needs the coordinator back too. A coordinator that
never comes back leaves the job training without failure handling until its last step.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from datetime import timedelta

import torch.distributed as dist

from megadyn.launch.console import print_line


def serve(host: str, port: int) -> dist.TCPStore:
    """The store's server on `host`:`port` (port 0: any free port, read `.port`)."""
    return dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m megadyn.launch.coordinator",
        description="Serve the job's rendezvous store apart from the training hosts.",
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    p.add_argument("--port", type=int, default=29400, help="port to listen on (default 29400)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        store = serve(args.host, args.port)
    except (RuntimeError, OSError) as e:
        print_line(f"megadyn coordinator: cannot serve on {args.host}:{args.port}: {e}")
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print_line(
        f"megadyn coordinator: serving on {args.host}:{store.port}; start each host with "
        f"python -m megadyn.launch --coordinator <this host>:{store.port} ..."
    )
    while not stop.wait(1.0):
        pass
    print_line("megadyn coordinator: stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
