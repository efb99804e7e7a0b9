"""Talk to a running megadyn job through its control store.

    python tools/elastic_ctl.py --host HOST --port PORT show
    python tools/elastic_ctl.py --port PORT layout --tp 1 --pp 2 [--vpp 2] [--sp] [--cp 2]
                                [--members 4]
    python tools/elastic_ctl.py --port PORT layout --pipelines 3 2     # --heterogeneous-pipelines
    python tools/elastic_ctl.py --port PORT scale 2 [--release]     # release: those processes exit
    python tools/elastic_ctl.py --port PORT scale 4                 # standby processes join
    python tools/elastic_ctl.py --port PORT drain 3                 # rank 3 leaves, exits 0

The job listens on --elastic-control-port (default MASTER_PORT + 1) of its rank-0 host. A request
is applied at the next step boundary (or at --at-iteration); the tool waits for the answer and
prints it: the new layout and the time of each phase, or the reason it was refused (the job then
goes on unchanged). A drain is what a SIGTERM to that process does (docs/elastic.md): the
answer says it was accepted, and the job's log has the reconfiguration; a refused one changes
nothing. Where no job answers on the port (within 3 s, or --timeout), or the job's control store
goes away before the answer (the job ended, or the process hosting it failed: a queued request
is then lost), one line says so and the tool exits 2 or 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # no C++ trace for a store that went away

import torch.distributed as dist  # noqa: E402

from megadyn.elastic.control.channel import ControlChannel, StoreGone, connect, queue_of  # noqa: E402
from megadyn.elastic.control.records import Request, RequestError  # noqa: E402

CONNECT_S, ANSWER_S = 3.0, 600.0
"""Without --timeout: how long to try to reach the job's control store, and to wait for an
answer."""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="the job's --elastic-control-port")
    p.add_argument(
        "--timeout",
        type=float,
        help=f"seconds to wait for the job's control store and then for the answer (default "
        f"{CONNECT_S:.0f} s to reach the store, {ANSWER_S:.0f} s for the answer)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "show",
        help="print the job's layout (its replicas), members, iteration and straggler scores",
    )
    lay = sub.add_parser("layout", help="change the layout")
    lay.add_argument("--tp", type=int)
    lay.add_argument("--pp", type=int)
    lay.add_argument(
        "--pipelines",
        type=int,
        nargs="+",
        metavar="STAGES",
        help="replicas of these stage counts (--heterogeneous-pipelines), instead of --pp",
    )
    lay.add_argument("--vpp", type=int, default=1)
    lay.add_argument("--sp", action="store_true", help="sequence parallel")
    lay.add_argument("--cp", type=int, default=1, help="context-parallel size")
    lay.add_argument("--members", type=int, help="number of processes to use (default: as now)")
    lay.add_argument("--at-iteration", type=int, default=0)
    sc = sub.add_parser("scale", help="use N processes (layout from --elastic-layout)")
    sc.add_argument("members", type=int)
    sc.add_argument(
        "--release", action="store_true", help="processes left out exit instead of waiting"
    )
    sc.add_argument("--at-iteration", type=int, default=0)
    dr = sub.add_parser("drain", help="take process RANK out of the job, as SIGTERM does")
    dr.add_argument("rank", type=int)
    a = p.parse_args(argv)
    try:
        request = None if a.command == "show" else request_of(a)
    except RequestError as e:
        p.error(str(e))

    where = f"{a.host}:{a.port}"
    answer_s = ANSWER_S if a.timeout is None else a.timeout
    try:
        store = connect(
            a.host,
            a.port,
            is_server=False,
            timeout_s=answer_s,
            connect_timeout_s=CONNECT_S if a.timeout is None else a.timeout,
        )
    except dist.DistError:
        print(
            f"no megadyn job answers on {where} (is the job running with "
            f"--elastic-control-port {a.port}?)",
            file=sys.stderr,
        )
        return 2
    try:
        return talk(ControlChannel(store), request, answer_s)
    except (StoreGone, dist.DistNetworkError):
        print(
            f"the job's control store on {where} went away before answering (the job ended, "
            "or the process hosting it failed: a queued request is lost; send it again once "
            "the job answers)",
            file=sys.stderr,
        )
        return 1


def talk(channel: ControlChannel, request: Request | None, answer_s: float) -> int:
    """Show the job's state, or send `request` and print its answer; the exit status."""
    if request is None:
        print(json.dumps(channel.state(), indent=1))
        return 0
    rid = channel.submit(request)
    print(f"request {rid} submitted: {request.to_json()}", flush=True)
    result = channel.result(rid, answer_s, queue_of(request))
    if result is None:
        print(
            f"no answer within {answer_s:.0f} s: the request is still queued in the job",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(result, indent=1))
    if result.get("status") == "refused":
        print(f"refused: {result.get('reason')}; {result.get('then', 'the job goes on')}")
    return 0 if result.get("status") in ("done", "accepted") else 2


def request_of(a: argparse.Namespace) -> Request:
    """The request the command line asks for (RequestError: refused before it is sent)."""
    if a.command == "drain":
        return Request(action="drain", rank=a.rank, by_operator=True)
    if a.command == "layout" and a.pipelines:
        fields = dict(tp=a.tp, pipelines=tuple(a.pipelines), vpp=a.vpp, sp=a.sp)
    elif a.command == "layout":
        if a.tp is None or a.pp is None:
            raise RequestError("a layout takes --tp and --pp (or --pipelines)")
        fields = dict(tp=a.tp, pp=a.pp, cp=a.cp, vpp=a.vpp, sp=a.sp, members=a.members)
    else:
        fields = dict(members=a.members, release=a.release)
    return Request(action=a.command, at_iteration=a.at_iteration, **fields)


if __name__ == "__main__":
    sys.exit(main())
