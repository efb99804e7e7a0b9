"""pretrain_gpt.py for the in-process recovery tests: each worker appends one JSON line per
completed step to rank<R>.jsonl (the iteration, wall time, and the global sample indices its
data-parallel replica read in that step), so the samples of a worker that is killed later are
known too; a worker that ends normally also writes its result (losses, reconfiguration and
recovery events) to rank<R>.json.

    python -m megadyn.launch ... tests/elastic/recover_worker.py <pretrain_gpt.py flags>

Environment: RECOVER_TEST_OUT (the directory for the files).
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megadyn.launch import errors  # noqa: E402
from megadyn.launch.run import main  # noqa: E402
from megadyn.training.trainer import Trainer  # noqa: E402

OUT = Path(os.environ["RECOVER_TEST_OUT"])
RANK = os.environ["RANK"]


def recording(train_step):
    def step(trainer):
        before = len(trainer.draws)
        result = train_step(trainer)
        drawn, trainer.draws = trainer.draws, trainer.draws[before:]
        samples = trainer.samples_drawn  # this step's (the trainer expands its records)
        trainer.draws = drawn
        members = list(trainer.groups.grid.members)
        line = {"it": trainer.iteration, "t": time.time(), "members": members, "samples": samples}
        with open(OUT / f"rank{RANK}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        return result

    return step


def run_and_write(argv: list[str]) -> None:
    Trainer.train_step = recording(Trainer.train_step)
    result = main(argv)
    result = dict(result, losses={str(k): v for k, v in result["losses"].items()})
    (OUT / f"rank{RANK}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(errors.run_reported(run_and_write))
