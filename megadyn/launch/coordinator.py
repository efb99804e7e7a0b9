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
`--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-conf is_host=0` (every agent connects
as a client) and points the workers' MASTER_ADDR and MASTER_PORT at the same store (agent.py).

The coordinator must run as long as the job: if it stops, each worker's heartbeat thread
(watchdog.py) finds the store silent and ends its worker after --elastic-heartbeat-timeout
seconds, and a restarted coordinator starts with an empty store (no rendezvous to restart
into): the job is started again, from its newest checkpoint.
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
