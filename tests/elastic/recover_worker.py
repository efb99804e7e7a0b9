"""pretrain_gpt.py for the in-process recovery tests: each worker appends one JSON line per
completed step to rank<R>.jsonl (the iteration, wall time, and the global sample indices its
data-parallel replica read in that step), so the samples of a worker that is killed later are
known too; a worker that ends normally also writes its result (losses, reconfiguration and
recovery events) to rank<R>.json.

    python -m megadyn.launch ... tests/elastic/recover_worker.py <pretrain_gpt.py flags>

Environment: RECOVER_TEST_OUT (the directory for the files); RECOVER_TEST_IN_RECOVERY
"<rank>:<signal>:<n>" (optional): that rank sends itself the signal (SIGKILL, SIGSTOP) when its
n-th recovery starts creating the new layout's groups, after the survivors connected their
span group: a failure while another one is handled, where the survivors wait on each other;
RECOVER_TEST_IN_RECONFIGURATION "<rank>:<signal>" (optional): that rank sends itself the signal
when its first live reconfiguration (an operator's request) starts building the new layout;
RECOVER_TEST_AWAIT_REQUEST (optional): the leader's first step boundary waits until an
operator's request is queued; RECOVER_TEST_STEP_S (optional): seconds each step sleeps before it
starts (a slower job, for tests that act between steps); RECOVER_TEST_AWAIT_REJOIN (optional):
the leader's first step boundary after a recovery waits until a replacement host's workers are
ready to join.
"""

import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megadyn.elastic import transition  # noqa: E402
from megadyn.elastic.control import controller  # noqa: E402
from megadyn.elastic.control.leader import Leader  # noqa: E402
from megadyn.elastic.recovery import recovery  # noqa: E402
from megadyn.launch import errors  # noqa: E402
from megadyn.launch.run import main  # noqa: E402
from megadyn.training.trainer import Trainer  # noqa: E402

OUT = Path(os.environ["RECOVER_TEST_OUT"])
RANK = os.environ["RANK"]
STEP_S = float(os.environ.get("RECOVER_TEST_STEP_S", "0"))


def recording(train_step):
    def step(trainer):
        time.sleep(STEP_S)
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


def failing_in(build_groups, spec: str, within):
    """`build_groups`, which first sends this process the signal at its n-th call from inside
    function `within` (the recovery, or a reconfiguration) when `spec` ("<rank>:<signal>:<n>")
    names this rank."""
    rank, name, nth = spec.split(":")
    calls = 0

    def build(*args, **kwargs):
        nonlocal calls
        calls += _inside(within)
        if rank == RANK and calls == int(nth) and _inside(within):
            os.kill(os.getpid(), getattr(signal, name))
        return build_groups(*args, **kwargs)

    return build


def _inside(function) -> bool:
    """Whether `function` is on this thread's stack."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not function.__code__:
        frame = frame.f_back
    return frame is not None


def awaiting_a_request(leader_decision):
    """The leader's decision, which at its first call waits until request 0 is queued (the
    operator's tool, started with the job, may connect after a tiny job's last step)."""

    waited = False

    def decide(self, trainer):
        nonlocal waited
        controller = self.controller
        if not waited and controller.epoch == 0:  # a store hosted anew after a failure is empty
            controller.channel.store.wait(["request/0"])
            waited = True
        return leader_decision(self, trainer)

    return decide


def awaiting_a_rejoin(rejoin_decision):
    """The leader's rejoin decision, which at its first call after a recovery waits until a
    replacement host's workers are ready (failures end the wait as at any step boundary)."""

    waited = False

    def decide(self, trainer):
        nonlocal waited
        controller = self.controller
        rejoins = controller.rejoins
        if not waited and controller.epoch >= 1 and rejoins is not None and not rejoins.formed:
            while rejoins.offer(controller.live) is None:
                controller.check_failures()
                time.sleep(0.05)
            waited = True
        return rejoin_decision(self, trainer)

    return decide


def run_and_write(argv: list[str]) -> None:
    Trainer.train_step = recording(Trainer.train_step)
    if os.environ.get("RECOVER_TEST_IN_RECOVERY"):
        spec = os.environ["RECOVER_TEST_IN_RECOVERY"]
        transition.build_groups = failing_in(transition.build_groups, spec, recovery.recover)
    if os.environ.get("RECOVER_TEST_IN_RECONFIGURATION"):
        spec = os.environ["RECOVER_TEST_IN_RECONFIGURATION"] + ":1"
        apply = controller.ElasticController.apply
        transition.build_groups = failing_in(transition.build_groups, spec, apply)
    if os.environ.get("RECOVER_TEST_AWAIT_REQUEST"):
        Leader.decide = awaiting_a_request(Leader.decide)
    if os.environ.get("RECOVER_TEST_AWAIT_REJOIN"):
        Leader._rejoin_decision = awaiting_a_rejoin(Leader._rejoin_decision)
    result = main(argv)
    result = dict(dataclasses.asdict(result), losses={str(k): v for k, v in result.losses.items()})
    (OUT / f"rank{RANK}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(errors.run_reported(run_and_write))
