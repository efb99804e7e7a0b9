"""pretrain_gpt.py for a test that needs each process's result: every worker writes its losses,
the samples it drew and its reconfiguration events as JSON when it ends normally.

    torchrun ... tests/elastic/drain_worker.py <pretrain_gpt.py flags, elastic mode>

Environment: DRAIN_TEST_OUT (the directory for rank<R>.json).
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import megadyn  # noqa: E402
from megadyn.launch import errors  # noqa: E402
from megadyn.launch.run import main  # noqa: E402


def run_and_write(argv: list[str]) -> None:
    result = main(argv)
    result = dict(dataclasses.asdict(result), losses={str(k): v for k, v in result.losses.items()})
    result["megadyn"] = megadyn.__file__  # the checkout the worker imported
    out = Path(os.environ["DRAIN_TEST_OUT"]) / f"rank{os.environ['RANK']}.json"
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(errors.run_reported(run_and_write))
