"""`python -m megadyn.launch`: torchrun's command line, whose agent keeps survivors (agent.py).

    python -m megadyn.launch --nproc-per-node 8 --max-restarts 3 pretrain_gpt.py ...
    python -m megadyn.launch --no-keep-survivors ...        # torchrun exactly
    MEGADYN_KEEP_SURVIVORS=0 python -m megadyn.launch ...   # the same

Every flag of torchrun (torch.distributed.run's own parser) means what it means there; the
added flags, --no-keep-survivors, --host-timeout, --coordinator and --replace-lost-host
(agent.py, hosts.py, coordinator.py, replacement.py), go before the training script like torchrun's own. With
survivors kept the workers see MEGADYN_KEEP_SURVIVORS=1 (torchrun_env.keep_survivors) and
TORCH_NCCL_ASYNC_ERROR_HANDLING=0: NCCL's watchdog then leaves up a process whose communicators
the in-process recovery aborts (megadyn/launch/failure_watch.py). A user who sets another value
gets one line saying what it costs.
"""

from __future__ import annotations

import os
import sys
from argparse import Namespace

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record

from megadyn.launch import rendezvous, replacement, torchrun_env
from megadyn.launch.agent import KEEP_SURVIVORS_ENV, launch


def parse_args(argv: list[str]) -> tuple[Namespace, bool]:
    """torchrun's arguments, and whether the agent keeps survivors."""
    parser = torchrun.get_args_parser()
    parser.prog = "python -m megadyn.launch"
    parser.add_argument(
        "--no-keep-survivors",
        "--no_keep_survivors",
        action="store_true",
        help="Stop every local worker when one fails, as torchrun does (also: "
        f"{KEEP_SURVIVORS_ENV}=0). By default the others keep running once their attempt "
        "declared that it recovers in-process, and the failure is recorded in the agent's "
        "store (megadyn/launch/failures.py).",
    )
    parser.add_argument(
        "--host-timeout",
        "--host_timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="With survivors kept: another host's agent whose keep-alive in the job's store is "
        "older than this is declared lost, its workers are recorded as failed and the "
        "survivors on the other hosts recover in-process (megadyn/launch/hosts.py; default 5, "
        "0 turns it off). Start the store apart from the training hosts with `python -m "
        "megadyn.launch.coordinator` so that any host, rank 0's included, can be lost.",
    )
    parser.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        default=None,
        help="The job's store served by `python -m megadyn.launch.coordinator` on a host that "
        "does not train: the rendezvous (torchrun's c10d rendezvous, as --rdzv-backend megadyn "
        "--rdzv-endpoint HOST:PORT), the workers' store and the failure records live there, so "
        "the job survives the loss of any training host (rank 0's included), and a restart of "
        "the coordinator at the same address (megadyn/launch/store_client.py).",
    )
    parser.add_argument(
        "--replace-lost-host",
        "--replace_lost_host",
        action="store_true",
        help="With --coordinator: this host takes the place of a lost host in the running job "
        "(megadyn/launch/replacement.py): it claims the lost host's slot, starts its ranks, and "
        "they join at a step boundary without restarting the survivors; the job grows back to "
        "its first layout. Give the job's --nproc-per-node, --rdzv-id, --max-restarts and "
        "training script with its flags.",
    )
    parser.add_argument(
        "--replace-wait",
        "--replace_wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="With --replace-lost-host: how long to wait for a host to be declared lost "
        "(default 60).",
    )
    args = parser.parse_args(argv)
    if args.replace_lost_host and args.coordinator is None:
        parser.error("--replace-lost-host needs --coordinator HOST:PORT (the job's store)")
    keep = not args.no_keep_survivors and os.environ.get(KEEP_SURVIVORS_ENV, "1") != "0"
    if args.host_timeout < 0:
        parser.error(f"--host-timeout must be >= 0 (0 = off), got {args.host_timeout:g}")
    if args.coordinator is not None:
        args.coordinator = _coordinator(parser, args)
    del args.no_keep_survivors
    return args, keep


def _coordinator(parser, args: Namespace) -> tuple[str, int]:
    """--coordinator HOST:PORT as torchrun's rendezvous flags; refuses flags that contradict
    it."""
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")
    if args.rdzv_backend not in ("static", "c10d", rendezvous.BACKEND):  # static: the default
        parser.error(
            f"--coordinator uses the c10d rendezvous, not --rdzv-backend {args.rdzv_backend}"
        )
    if args.rdzv_endpoint not in ("", args.coordinator):
        parser.error(
            f"--coordinator {args.coordinator} is the rendezvous endpoint; --rdzv-endpoint "
            f"{args.rdzv_endpoint} contradicts it (give one of them)"
        )
    args.rdzv_backend, args.rdzv_endpoint = rendezvous.BACKEND, args.coordinator
    return host, int(port)


# what the in-process recovery needs of NCCL in its workers' environment: name -> value
NCCL_FOR_RECOVERY = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}


def set_worker_environment(env: dict[str, str]) -> list[str]:
    """Set what the in-process recovery needs in `env` (the workers inherit it), keeping a
    value the user set; returns one line per value kept that costs the recovery."""
    lines = []
    for name, value in NCCL_FOR_RECOVERY.items():
        mine = env.setdefault(name, value)
        if mine != value:
            lines.append(
                f"megadyn.launch: {name}={mine} (set by you) lets NCCL's watchdog end a worker "
                f"whose communicators the in-process recovery aborts, so a failure on GPUs "
                f"takes the restart path (--max-restarts); {name}={value} keeps survivors"
            )
    return lines


@record
def main(argv: list[str] | None = None) -> None:
    args, keep = parse_args(sys.argv[1:] if argv is None else argv)
    if keep:  # the workers inherit the launcher's environment, as torchrun's OMP_NUM_THREADS
        os.environ[KEEP_SURVIVORS_ENV] = "1"
        for line in set_worker_environment(os.environ):
            print(line, file=sys.stderr, flush=True)
    elif os.environ.get(KEEP_SURVIVORS_ENV) == "1":  # --no-keep-survivors: torchrun's workers
        del os.environ[KEEP_SURVIVORS_ENV]
    host_timeout, coordinator = args.host_timeout, args.coordinator
    if args.replace_lost_host:
        os.environ[torchrun_env.COORDINATOR_ENV] = "1"
        sys.exit(replacement.replace(args, host_timeout, coordinator, args.replace_wait))
    del args.host_timeout, args.coordinator, args.replace_lost_host, args.replace_wait
    if coordinator is not None:  # the workers' store client reconnects (store_client.py)
        os.environ[torchrun_env.COORDINATOR_ENV] = "1"
    launch(args, keep_survivors=keep, host_timeout_s=host_timeout, coordinator=coordinator)


if __name__ == "__main__":
    main()
