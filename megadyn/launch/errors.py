"""One failure, one message: how pretrain_gpt.py ends a job whose run raised.

    if __name__ == "__main__":
        sys.exit(errors.run_reported(main))   # returns only if `main` returned or sys.exit-ed

A failure on one rank used to print every rank's traceback, gloo's "Connection closed by peer"
from the ranks waiting for it, and torchrun's summary. Now each exception that ends `main` is
one of three kinds:

    user      ConfigError, LayoutError, CheckpointError, a damaged dataset, a missing or
              unreadable file, a ValueError that names a --flag: the message is the error's own
              (it names the flag or file and what to do); exit status USER_ERROR_EXIT
    internal  anything else: "Type: message (at file:line in function)"; INTERNAL_ERROR_EXIT
    peer      a collective or store operation failed because another process stopped (gloo's
              "Connection closed by peer", NCCL and store errors): this rank is not the cause;
              PEER_FAILED_EXIT

Under torchrun the ranks agree through the elastic agent's store (key space of the attempt,
`errors/first`) on what was reported first: a rank prints its message unless that is already
there (so an error that every rank meets prints once), and a peer-failed rank prints nothing
when a rank reported an error, else one line for the whole job (PEER_LOST_LINE: a kill -9 or a
crash leaves no message; torchrun's log names the rank and its signal). Each failed rank also
writes the message into torchrun's error file (TORCHELASTIC_ERROR_FILE), so the "Root Cause" of
torchrun's summary quotes it instead of a link to torch's docs. MEGADYN_DEBUG=1 prints each
failed rank's traceback as well. Ctrl-C exits with 130, silently.

A failed rank leaves with os._exit after flushing its streams: a thread of the failed step may be
waiting in a collective that nobody will finish, and interpreter exit would wait for it.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from megadyn.core.layout import LayoutError
from megadyn.data.indexed_dataset import IndexedDatasetError
from megadyn.launch import torchrun_env
from megadyn.launch.distributed_init import agent_store, attempt_prefix
from megadyn.training.checkpoint import CheckpointError
from megadyn.training.config import ConfigError

DEBUG_ENV = "MEGADYN_DEBUG"
"""Set to 1 for the traceback of every failed rank (besides the message)."""
USER_ERROR_EXIT = 2
"""A flag or an input file to fix (as argparse exits on a bad command line)."""
INTERNAL_ERROR_EXIT = 1
"""An unexpected exception: a defect of megadyn or of the machine."""
PEER_FAILED_EXIT = 69
"""This rank stopped because another one did (EX_UNAVAILABLE: a peer it needs is gone)."""
PROG = "pretrain_gpt.py"

USER_ERRORS = (ConfigError, LayoutError, CheckpointError, IndexedDatasetError, OSError)
ADVICE = {
    IndexedDatasetError: "a dataset of --data-path; write it again with tools/preprocess_data.py",
}
"""What to do, for errors whose message names the file but not the flag."""
PEER_LOST = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|Timed out waiting .* for (recv|send)"
    r"|NCCL communicator was aborted|remote process exited",
)
PEER_LOST_LINE = (
    f"{PROG}: stopped: another process of the job ended without a message (killed, crashed or "
    "unreachable; torchrun's log names it)"
)
STORE_TIMEOUT = timedelta(seconds=5)
PEER_GRACE_S = 1.0
"""How long a rank that stopped because a rank of its own agent failed waits before it exits:
torchrun's agent (polling every 0.1 s by default) sees the failed rank first and SIGTERMs it."""


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def run_reported(main: Callable[[list[str]], object], argv: list[str] | None = None) -> int:
    """`main(argv)`; 0 when it returns, the status of a SystemExit. Any other exception is
    reported as the module docstring says and the process exits here."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # noqa: BLE001 - reported once, then the process exits
        code = 130 if isinstance(e, KeyboardInterrupt) else report(e)  # Ctrl-C: no message
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0


def report(exc: BaseException, rank: int | None = None) -> int:
    """Print `exc` as one message (or nothing), write torchrun's error file; the exit status."""
    rank = torchrun_env.current().rank if rank is None else rank
    kind, text = describe(exc)
    if debug():
        traceback.print_exception(exc)
    first = _publish(rank, kind, text)  # None: no store to agree through
    if kind == "peer" and first is not None and first["kind"] != "peer":
        # quiet: the rank that failed printed it; torchrun's summary may pick this rank
        text = f"stopped because rank {first['rank']} failed (its message is printed above)"
    elif first is None or first["rank"] == rank or first["text"] != text:
        print(text, file=sys.stderr, flush=True)
    write_error_file(text, exc)
    if kind == "peer" and first is not None and first["agent"] == _agent():
        # the failed rank is this agent's: its SIGTERM comes within a monitor interval, and
        # the failed rank, seen first, is the "Root Cause" of its summary
        time.sleep(PEER_GRACE_S)
    return {"user": USER_ERROR_EXIT, "peer": PEER_FAILED_EXIT}.get(kind, INTERNAL_ERROR_EXIT)


def describe(exc: BaseException) -> tuple[str, str]:
    """The kind of `exc` (peer, user or internal: module docstring) and its one message."""
    if _is_checkpoint_exception(exc):  # DCP hands every rank's failure to every rank
        failed = [(r, e, tb) for r, (e, tb) in sorted(exc.failures.items()) if _kind(e) != "peer"]
        if not failed:
            return "peer", PEER_LOST_LINE
        failed_rank, inner, frames = failed[0]
        kind = _kind(inner)
        return kind, _message(inner, kind, frames, f"rank {failed_rank}: ")
    kind = _kind(exc)
    if kind == "peer":
        return kind, PEER_LOST_LINE
    return kind, _message(exc, kind, traceback.extract_tb(exc.__traceback__))


def _kind(exc: BaseException) -> str:
    """peer when `exc` or what it came from says a peer is gone, else user or internal."""
    for e in _chain(exc):
        if _is_checkpoint_exception(e):
            if all(_kind(inner) == "peer" for inner, _ in e.failures.values()):
                return "peer"
        elif isinstance(e, dist.DistError) or PEER_LOST.search(str(e)):
            return "peer"
    if isinstance(exc, USER_ERRORS) or (
        type(exc) is ValueError and re.search(r"(^|\s)--[a-z]", str(exc))
    ):
        return "user"
    return "internal"


def _message(exc: BaseException, kind: str, frames, on: str = "") -> str:
    """The error's own message for a user error, with its type and place otherwise; `on` leads
    it (the rank that failed, where another rank reports it)."""
    text = str(exc) or type(exc).__name__
    for e in _chain(exc)[1:]:  # a checkpoint error quoting DCP's multi-line report
        if _is_checkpoint_exception(e) and str(e) in text:
            text = text.replace(str(e), _one_line(e))
    if kind == "user":
        advice = next((a for t, a in ADVICE.items() if isinstance(exc, t)), None)
        return f"{PROG}: error: {on}{text}" + (f" ({advice})" if advice else "")
    last = frames[-1] if frames else None
    where = f" (at {_short(last.filename)}:{last.lineno} in {last.name})" if last else ""
    return (
        f"{PROG}: error: {on}{type(exc).__name__}: {text}{where}; "
        f"{DEBUG_ENV}=1 prints the traceback"
    )


def _is_checkpoint_exception(exc: BaseException) -> bool:
    """torch.distributed.checkpoint's CheckpointException (by name: importing the checkpoint
    library takes seconds)."""
    return type(exc).__name__ == "CheckpointException" and hasattr(exc, "failures")


def _one_line(exc) -> str:
    """A CheckpointException's failures, one clause per rank."""
    return "; ".join(
        f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(exc.failures.items())
    )


def write_error_file(text: str, exc: BaseException) -> None:
    """torchrun's error file of this worker, in the format of torch's `record` (its summary
    shows `message`, or the traceback where there is one: only under MEGADYN_DEBUG=1)."""
    path = torchrun_env.current().error_file
    if not path:
        return
    info = {"timestamp": str(int(time.time()))}
    if debug():
        info["py_callstack"] = "".join(traceback.format_exception(exc)) + text
    try:  # whole or not at all: torchrun's agent fails on a half-written file (a SIGTERM)
        with open(f"{path}.{os.getpid()}", "w") as f:
            json.dump({"message": {"message": text, "extraInfo": info}}, f)
        os.replace(f.name, path)
    except OSError:
        pass  # the summary then links to torch's docs; the message is printed already


def _publish(rank: int, kind: str, text: str) -> dict | None:
    """Offer this rank's report as the attempt's first; the first one (maybe this), or None
    outside torchrun or when the agent's store does not answer."""
    restart = torchrun_env.current().restart_count
    if restart is None:
        return None
    mine = json.dumps({"rank": rank, "agent": _agent(), "kind": kind, "text": text})
    try:
        store = dist.PrefixStore(attempt_prefix(restart) + "errors/", agent_store(STORE_TIMEOUT))
        return json.loads(store.compare_set("first", "", mine))
    except Exception:  # noqa: BLE001 - the agent is gone: say it here
        return None


def _agent() -> str:
    """The torchrun agent (node rank) this worker belongs to."""
    return torchrun_env.current().group_rank


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it came from (__cause__, __context__)."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain and len(chain) < 16:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _short(path: str) -> str:
    """`path` from the megadyn checkout or site-packages on, for the message."""
    for mark in ("/megadyn/", "/site-packages/"):
        if mark in path:
            return path[path.index(mark) + 1 :]
    return os.path.basename(path)
