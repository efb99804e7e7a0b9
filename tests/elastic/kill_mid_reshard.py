"""pretrain_gpt.py for a test: one worker SIGKILLs itself in the middle of a live reshard, after
its first round of transfers (test only; megadyn has no fault injection).

    torchrun ... tests/elastic/kill_mid_reshard.py <pretrain_gpt.py flags, elastic mode>

Environment: KILL_RANK (the worker that dies). Only the first attempt
(TORCHELASTIC_RESTART_COUNT 0) dies; the restarted workers run normally.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pretrain_gpt  # noqa: E402
from megadyn.elastic.reshard import executor  # noqa: E402


def install() -> None:
    rank = os.environ["KILL_RANK"]
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or os.environ["RANK"] != rank:
        return
    real_round = executor._run_round

    def run_round(transfers, *args):
        real_round(transfers, *args)
        if transfers:  # some of this rank's pieces moved, the rest never will
            print(f" test: rank {rank} killed during the reshard", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    executor._run_round = run_round


if __name__ == "__main__":
    install()
    pretrain_gpt.main()
