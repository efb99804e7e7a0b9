"""SIGTERM drains a worker as a live scale-in (elastic mode, --elastic-recovery in-process).

One torchrun job of 5 processes, 3 members at dp 3 and 2 standby processes, gets four SIGTERMs
in turn, each sent once the job logged the previous one's outcome:

    rank 4 (standby)        it leaves the live set and exits 0; the layout stays
    rank 1 (member)         standby rank 3 takes its place in the same layout (dp 3)
    rank 2 (member)         no standby left: the layout planner's layout for 2 members
    rank 0 (leader, hosts   refused with one line; --exit-signal-handler: every member saves a
      the control store)    checkpoint at that step boundary and the job exits 0

Every loss equals an uninterrupted run's, and every sample is drawn once.
"""

import json
import os
import re
import signal
import sys
from collections import Counter
from pathlib import Path

from recovery_helpers import LINE, rank_of, run_torchrun, workers_of

from megadyn.testing import free_port, run_pretrain, spawn

TINY = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 --make-vocab-size-divisible-by 8 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 60 --micro-batch-size 1 --global-batch-size 12 "
    "--lr 1e-3 --lr-decay-style constant --hidden-dropout 0 --attention-dropout 0 --seed 7 "
    "--log-interval 1 --eval-interval 0 --num-workers 0 --use-distributed-optimizer"
).split()
DRAIN = re.compile(
    r"elastic: event: drain \| epoch: \d+ \| iteration: (\d+) \| old: (\S+) \| new: (\S+)"
)
REFUSED = re.compile(r"elastic: drain of rank 0 refused: rank 0 hosts the control store")
SIGTERMS = [4, 1, 2, 0]  # the rank that gets the next SIGTERM, in turn


def test_sigterm_drains_members_and_standby_processes(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    port, master = free_port(), free_port()
    argv = ["tests/elastic/drain_worker.py", *TINY, "--train-iters", "2000",
            "--elastic-initial-members", "3", "--elastic-control-port", str(port),
            "--exit-signal-handler", "--save", str(tmp_path / "ckpt"), "--save-interval", "10000"]  # fmt: skip
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "5"),
        *("--master-port", str(master), *argv),
    ]
    sent, seen = [], {"iteration": 0, "drains": 0}

    def on_line(line, agents):
        m = LINE.search(line)
        seen["iteration"] = int(m.group(1)) if m else seen["iteration"]
        seen["drains"] += bool(DRAIN.search(line))
        # the next SIGTERM once the previous drain is logged and two more steps ran
        if len(sent) < len(SIGTERMS) and len(sent) == seen["drains"] and seen["iteration"] > 2:
            rank = SIGTERMS[len(sent)]
            pid = next(p for p in workers_of(agents[0].pid) if rank_of(p) == rank)
            os.kill(pid, signal.SIGTERM)
            sent.append((rank, seen["iteration"]))

    env = {"DRAIN_TEST_OUT": str(out), "PYTHONPATH": str(Path(__file__).parents[2])}
    (code,), log = run_torchrun([cmd], on_line, env=env, deadline_s=150)
    print(log)
    assert code == 0, log[-3000:]
    assert [r for r, _ in sent] == SIGTERMS, sent
    drains = DRAIN.findall(log)
    assert [(old, new) for _, old, new in drains[:2]] == [
        ("tp1xpp1xdp3", "tp1xpp1xdp3"),  # standby 4 left; standby 3 took rank 1's place
        ("tp1xpp1xdp3", "tp1xpp1xdp3"),
    ], drains
    assert len(drains) == 3 and drains[2][1] == "tp1xpp1xdp3", drains
    assert re.search(r"xdp\d|tp\dxpp\d", drains[2][2]) and drains[2][2] != drains[2][1]
    assert REFUSED.search(log) and "every member saves a checkpoint" in log, log[-3000:]

    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(results) == [0, 1, 2, 3, 4], sorted(results)  # every process ended normally
    assert {r["megadyn"] for r in results.values()} == {
        str(Path(__file__).parents[2] / "megadyn" / "__init__.py")
    }
    losses = {}
    for r in results.values():
        losses.update({int(k): v for k, v in r["losses"].items()})
    last = max(losses)
    assert sorted(losses) == list(range(1, last + 1))
    assert (tmp_path / "ckpt" / f"iter_{last:07d}").is_dir()  # saved where the job stopped
    reference = spawn(run_pretrain, world=1, args=(TINY + ["--train-iters", str(last)],))[0]
    for i, want in enumerate(reference, start=1):
        assert abs(losses[i] - want) <= 1e-5 * abs(want), (i, losses[i], want)
    drawn = Counter(s for r in results.values() for s in r["samples"])
    assert sorted(drawn) == list(range(12 * last)) and set(drawn.values()) == {1}
