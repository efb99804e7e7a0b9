"""An operator's session, as the README tells it: `torchrun pretrain_gpt.py` with standby
processes, and several `tools/elastic_ctl.py` requests sent in a row. Every request completes or
is refused with a reason, and the job runs to its last iteration: a refused drain changes
nothing, even under --exit-signal-handler --save (which a SIGTERM's refused drain obeys). With no
job on the port, the tool says so in one line within seconds."""

import os
import re
import subprocess
import sys
import time

import pytest

from megadyn.testing import free_port
from tests.tiny import RUN, tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = tiny_args(
    RUN,
    num_layers=4,
    make_vocab_size_divisible_by=8,
    global_batch_size=8,
    log_interval=10,
    train_iters=300,
    use_distributed_optimizer=True,
)
REQUESTS = [  # sent one after another (each tool starts in seconds; the job has 300 steps)
    ["drain", "0"],  # rank 0 hosts the control store: refused, and nothing changes
    ["layout", "--tp", "1", "--pp", "2", "--at-iteration", "20"],  # standby processes sit out
    ["scale", "4", "--at-iteration", "35"],  # they join (pinned: tp1 x pp2 x dp2)
    ["scale", "2", "--at-iteration", "50"],  # and go back to standby
    ["layout", "--tp", "2", "--pp", "1", "--at-iteration", "65"],  # members only again
    ["layout", "--tp", "1", "--pp", "1", "--at-iteration", "100000"],  # never due: refused
]


@pytest.mark.timeout(480)
def test_requests_in_a_row_with_standby_processes(tmp_path):
    port, master = free_port(), free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # each tool starts a Python that imports torch: seconds apiece on a loaded machine, while a
    # tiny step takes 30 ms. Rank 0 sleeps 5 ms before each forward of its first chunk
    # (rank_timing.py), so that the job outlasts the six submissions it must answer
    job_env = dict(env, MEGADYN_TEST_SLOW_RANK="0:0.005")
    job_log = open(tmp_path / "job.log", "w+")
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "--master-port", str(master), "pretrain_gpt.py", *TINY,
         "--tensor-model-parallel-size", "2", "--elastic-initial-members", "2",
         "--elastic-layout", "pinned", "--elastic-control-port", str(port),
         "--exit-signal-handler", "--save", str(tmp_path / "ckpt"), "--save-interval", "1000"],
        cwd=ROOT, env=job_env, stdout=job_log, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    tools = []
    try:
        for request in REQUESTS:
            tool = subprocess.Popen(
                [sys.executable, "tools/elastic_ctl.py", "--port", str(port), "--timeout", "240",
                 *request],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            first = tool.stdout.readline()  # submitted: the next one queues behind it
            assert "submitted" in first, first + tool.stdout.read()
            tools.append((tool, first))
        answers = [(t.wait(timeout=240), first + t.stdout.read()) for t, first in tools]
        job.wait(timeout=240)
    finally:
        for p in [job] + [t for t, _ in tools]:
            if p.poll() is None:
                p.kill()
        job_log.seek(0)
        log = job_log.read()
        print(log)
    assert job.returncode == 0, log[-3000:]
    rc, out = answers[0]
    refused = "refused: rank 0 hosts the control store (--elastic-control-port)"
    assert rc == 2 and refused in out and out.endswith("; the job goes on unchanged\n"), out
    assert "the job goes on unchanged" in log and "saves a checkpoint" not in log, log[-3000:]
    for rc, out in answers[1:-1]:
        assert rc == 0 and '"status": "done"' in out, out
    rc, out = answers[-1]
    assert rc != 0 and "refused" in out and "finished at iteration 300" in out, out
    news = re.findall(
        r"elastic: event: \w+ \| epoch: \d+ \| iteration: \d+ \| old: \S+ \| new: (\S+)", log
    )
    assert news == ["tp1xpp2xdp1", "tp1xpp2xdp2", "tp1xpp2xdp1", "tp2xpp1xdp1"], log[-3000:]
    assert re.search(r"iteration\s+300/\s+300", log), log[-3000:]


def test_no_job_on_the_port():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.monotonic()
    tool = subprocess.run(
        [sys.executable, "tools/elastic_ctl.py", "--port", str(free_port()), "show"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    took = time.monotonic() - start
    out = tool.stdout + tool.stderr
    assert tool.returncode == 2 and len(out.splitlines()) == 1, out
    assert out.startswith("no megadyn job answers on 127.0.0.1:"), out
    assert "--elastic-control-port" in out and took < 15, (took, out)
