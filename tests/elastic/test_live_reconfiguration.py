"""Live reconfiguration end to end: a run that changes layout four times (scale in and out
included) trains exactly like an uninterrupted run and consumes every sample once."""

import threading
from collections import Counter

from megadyn.testing import free_port, run_pretrain, spawn
from tests.tiny import TRAINING, tiny_args

LIVE = {
    **TRAINING,
    "num_layers": 4,
    "global_batch_size": 8,
    "train_iters": 10,
    "use_distributed_optimizer": True,
}
"""The job that changes layout live (TRAINING at 4 layers, 8 samples a step, 10 steps)."""
ARGS = tiny_args(LIVE)

REQUESTS = [
    {"action": "layout", "tp": 1, "pp": 2, "members": 4, "at_iteration": 2},  # tp1 x pp2 x dp2
    {"action": "layout", "tp": 2, "pp": 1, "members": 2, "at_iteration": 4},  # scale in: tp2 on 2
    {"action": "layout", "tp": 1, "pp": 2, "vpp": 2, "members": 4, "at_iteration": 6},  # scale out
    {"action": "layout", "tp": 1, "pp": 1, "members": 4, "at_iteration": 8},  # dp4
]


def operator(port, requests):
    from megadyn.elastic.control.channel import ControlChannel, connect

    channel = ControlChannel(connect("127.0.0.1", port, is_server=False))
    for r in requests:
        channel.submit(r)


def merged_losses(results, reference, rtol=1e-5) -> dict:
    """Every rank's losses by iteration, checked against an uninterrupted run's."""
    losses = {}
    for r in results:
        losses.update(r.losses)
    assert sorted(losses) == list(range(1, len(reference) + 1))
    for i, want in enumerate(reference, start=1):
        assert abs(losses[i] - want) <= rtol * abs(want), (i, losses[i], want)
    return losses


def elastic_run(rank, world, argv, port, requests):
    import pretrain_gpt

    if rank == 0:
        threading.Thread(target=operator, args=(port, requests), daemon=True).start()
    return pretrain_gpt.main(list(argv))


def test_four_reconfigurations_match_uninterrupted_run():
    reference = spawn(run_pretrain, world=1, args=(ARGS,))[0].history
    port = free_port()
    argv = ARGS + [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--elastic-control-port",
        str(port),
    ]
    results = spawn(elastic_run, world=4, args=(argv, port, REQUESTS), timeout_s=120)
    merged_losses(results, reference)
    drawn = Counter(s for r in results for s in r.samples)
    assert sorted(drawn) == list(range(80)) and set(drawn.values()) == {1}
    events = [e for r in results for e in r.events]
    assert {e["new"] for e in events} == {
        "tp1xpp2xdp2",
        "tp2xpp1xdp1",
        "tp1xpp2xdp2xvpp2",
        "tp1xpp1xdp4",
    }


TOOL_COMMANDS = (
    ("bad", ["layout", "--tp", "8", "--pp", "1"]),
    ("good", ["scale", "2", "--release"]),
)


def operator_tool(rank, world, argv, port, commands=TOOL_COMMANDS):
    """pretrain_gpt.py on every rank; on rank 0 tools/elastic_ctl.py also sends `commands`
    ((name, argv) in order); the job's result and each one's (return code, output) (none on
    other ranks)."""
    import subprocess
    import sys

    import pretrain_gpt

    if rank != 0:
        return pretrain_gpt.main(list(argv)), {}
    base = [sys.executable, "tools/elastic_ctl.py", "--port", str(port), "--timeout", "120"]
    result = {}

    def drive():  # started before the job: the tool waits for the control store to come up
        for name, cmd in commands:
            result[name] = subprocess.run(base + cmd, capture_output=True, text=True)

    t = threading.Thread(target=drive, daemon=True)
    t.start()
    out = pretrain_gpt.main(list(argv))
    t.join(timeout=120)
    return out, {k: (v.returncode, v.stdout + v.stderr) for k, v in result.items()}


STANDBY_REQUESTS = [
    {"action": "layout", "tp": 1, "pp": 2, "members": 4, "at_iteration": 2},  # standby join
    {"action": "layout", "tp": 2, "pp": 1, "members": 2, "at_iteration": 4},  # back to standby
    {"action": "layout", "tp": 1, "pp": 2, "at_iteration": 6},  # members only; 2 sit it out
    {"action": "scale", "members": 4, "at_iteration": 8},  # standby join again
]


def test_standby_processes_sit_out_a_change_among_the_members():
    # 2 members at tp 2 and 2 standby processes: every change completes, whether the standby
    # processes join, go back, or take no part; the run trains like an uninterrupted one
    reference = spawn(run_pretrain, world=1, args=(ARGS,))[0].history
    port = free_port()
    argv = ARGS + [
        "--tensor-model-parallel-size",
        "2",
        "--elastic-initial-members",
        "2",
        "--elastic-layout",
        "pinned",
        "--elastic-control-port",
        str(port),
    ]
    results = spawn(elastic_run, world=4, args=(argv, port, STANDBY_REQUESTS), timeout_s=120)
    merged_losses(results, reference)
    drawn = Counter(s for r in results for s in r.samples)
    assert sorted(drawn) == list(range(80)) and set(drawn.values()) == {1}
    last = [e["new"] for e in sorted(results[0].events, key=lambda e: e["epoch"])]
    assert last == ["tp1xpp2xdp2", "tp2xpp1xdp1", "tp1xpp2xdp1", "tp1xpp2xdp2"], last


def test_operator_tool_refuses_bad_request_and_releases_processes():
    # 200 steps: time for the tool; lr 1e-3: not chaotic
    args = tiny_args(LIVE, train_iters=200, lr="1e-3", min_lr="1e-4")
    reference = spawn(run_pretrain, world=1, args=(args,))[0].history
    port = free_port()
    argv = args + ["--elastic-control-port", str(port), "--elastic-layout", "pinned"]
    results = spawn(operator_tool, world=4, args=(argv, port), timeout_s=120)
    tool, results = results[0][1], [r for r, _ in results]
    (bad_rc, bad_out), (good_rc, good_out) = tool["bad"], tool["good"]
    assert bad_rc == 2 and "refused" in bad_out and "--tensor-model-parallel-size" in bad_out, (
        bad_out
    )
    assert good_rc == 0 and '"new": "tp1xpp1xdp2"' in good_out, good_out
    losses = {}
    for r in results:
        losses.update(r.losses)
    for i, want in enumerate(reference, start=1):  # nothing lost: the run went on unchanged
        assert abs(losses[i] - want) <= 1e-5 * abs(want), (i, losses[i], want)
    drawn = Counter(s for r in results for s in r.samples)
    assert sorted(drawn) == list(range(1600)) and set(drawn.values()) == {1}


def test_rng_streams_move_with_the_state():
    # with dropout on, a reconfiguration that keeps every rank's (pp, tp) coordinates continues the
    # dropout streams exactly: losses equal an uninterrupted run (reseeding would repeat masks)
    dropout = tiny_args(LIVE, hidden_dropout=0.1, attention_dropout=0.1)
    layout = ["--tensor-model-parallel-size", "2"]
    reference = spawn(run_pretrain, world=2, args=(dropout + layout,))[1].history
    port = free_port()
    argv = dropout + layout + ["--elastic-control-port", str(port)]
    requests = [
        {"action": "layout", "tp": 2, "pp": 1, "members": 2, "at_iteration": i} for i in (3, 6)
    ]
    results = spawn(elastic_run, world=2, args=(argv, port, requests), timeout_s=120)
    losses = {}
    for r in results:
        losses.update(r.losses)
    assert len(results[0].events) == 2
    for i, want in enumerate(reference, start=1):
        assert abs(losses[i] - want) <= 1e-6 * abs(want), (i, losses[i], want)


def test_fp16_loss_scale_survives_a_live_change():
    # the dynamic loss scale starts at 2**32, so the first steps overflow and halve it; a live
    # change must carry the reduced scale: a fresh scaler would overflow (and skip) again
    fp16 = ARGS + ["--fp16", "--initial-loss-scale", str(2**20), "--hysteresis", "1"]
    tp2 = fp16 + ["--tensor-model-parallel-size", "2"]
    reference = spawn(run_pretrain, world=2, args=(tp2,))[1].history
    port = free_port()
    argv = fp16 + ["--tensor-model-parallel-size", "2", "--elastic-control-port", str(port)]
    requests = [{"action": "layout", "tp": 1, "pp": 2, "at_iteration": 6}]
    results = spawn(elastic_run, world=2, args=(argv, port, requests), timeout_s=120)
    assert len(results[0].events) == 1
    merged_losses(results, reference)


def test_precision_aware_optimizer_state_moves_exactly():
    # bf16 weights with remainders in place of fp32 main weights: a live change carries the
    # fp32 main value (joined) and sets weight and remainder from it again; the run goes on as
    # an uninterrupted one, bit for bit (dp 2 with the distributed optimizer, rebuilt twice)
    flags = ARGS + ["--bf16", "--use-precision-aware-optimizer"]
    reference = spawn(run_pretrain, world=2, args=(flags,))[1].history
    port = free_port()
    argv = flags + ["--elastic-control-port", str(port)]
    requests = [
        {"action": "layout", "tp": 1, "pp": 1, "members": 2, "at_iteration": i} for i in (3, 6)
    ]
    results = spawn(elastic_run, world=2, args=(argv, port, requests), timeout_s=120)
    assert len(results[0].events) == 2
    losses = merged_losses(results, reference, rtol=0)
    assert losses[10] < losses[1]
