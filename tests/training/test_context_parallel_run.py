"""pretrain_gpt.py's job with context parallelism trains like cp 1: at cp 2 with the
distributed optimizer sharded over dp x cp, after a resume at cp 1 from its checkpoint, across
live changes tp 2 -> cp 2 -> dp 2 (tools/elastic_ctl.py's requests), and with the document
flags on packed mock samples (also with --cp-placement dynamic); with attention dropout, cp 2 draws the same masks in every run
and under recomputation."""

import os
from collections import Counter

from megadyn.testing import free_port, spawn
from tests.elastic.test_live_reconfiguration import LIVE, elastic_run, operator_tool, run_pretrain
from tests.tiny import tiny_args
from tests.training.test_training_run import COMMON, close, train


def test_cp2_with_distributed_optimizer_trains_like_cp1_and_resumes_at_cp1(single, tmp_path):
    save = str(tmp_path / "ckpt")
    cp2 = train(
        2,
        "--context-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--save",
        save,
        "--save-interval",
        "3",
    )
    close(cp2, single)
    resumed = train(1, "--load", os.path.join(save, "iter_0000003"))  # cp 2 -> cp 1
    close(resumed, single[3:])


def test_live_changes_tp2_cp2_dp2_train_like_cp1(single):
    port = free_port()
    argv = COMMON + [
        "--tensor-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--elastic-control-port",
        str(port),
    ]
    requests = [
        {"action": "layout", "tp": 1, "pp": 1, "cp": 2, "at_iteration": 2},
        {"action": "layout", "tp": 1, "pp": 1, "cp": 1, "at_iteration": 4},  # dp 2
    ]
    results = spawn(elastic_run, world=2, args=(argv, port, requests), timeout_s=120)
    losses = {}
    for r in results:
        losses.update(r.losses)
    close([losses[i] for i in range(1, len(single) + 1)], single)
    drawn = Counter(s for r in results for s in r.samples)  # each sample read once
    assert sorted(drawn) == list(range(4 * len(single))) and set(drawn.values()) == {1}
    events = [e for r in results for e in r.events]
    assert {e["new"] for e in events} == {"tp1xcp2xpp1xdp1", "tp1xpp1xdp2"}


def test_a2a_job_refuses_a_cp_its_heads_do_not_allow_and_takes_the_next_request():
    """An operator's elastic_ctl.py requests to an a2a job at cp 2 with 2 key/value heads:
    `layout --cp 4` is refused by name and the job goes on; `layout --cp 1` (dp 4) is taken;
    the losses are those of the uninterrupted single-process run."""
    args = tiny_args(LIVE, train_iters=200, lr="1e-3", min_lr="1e-4")  # 200: time for the tool
    gqa = ["--group-query-attention", "--num-query-groups", "2", "--cp-comm-type", "a2a"]
    reference = spawn(run_pretrain, world=1, args=(args + gqa[:3],))[0].history
    port = free_port()
    argv = args + gqa + ["--context-parallel-size", "2", "--elastic-control-port", str(port)]
    commands = (
        ("bad", ["layout", "--tp", "1", "--pp", "1", "--cp", "4"]),
        ("good", ["layout", "--tp", "1", "--pp", "1", "--cp", "1"]),
    )
    results = spawn(operator_tool, world=4, args=(argv, port, commands), timeout_s=120)
    tool, results = results[0][1], [r for r, _ in results]
    (bad_rc, bad_out), (good_rc, good_out) = tool["bad"], tool["good"]
    assert bad_rc == 2 and "refused" in bad_out and "--cp-comm-type a2a" in bad_out, bad_out
    assert good_rc == 0 and '"new": "tp1xpp1xdp4"' in good_out, good_out
    losses = {}
    for r in results:
        losses.update(r.losses)
    for i, want in enumerate(reference, start=1):
        assert abs(losses[i] - want) <= 1e-5 * abs(want), (i, losses[i], want)
    drawn = Counter(s for r in results for s in r.samples)
    assert sorted(drawn) == list(range(1600)) and set(drawn.values()) == {1}


DOCUMENT_FLAGS = ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss")


def test_document_flags_train_alike_at_cp2_and_change_the_losses(single):
    """Also under --cp-placement dynamic (blocks of 2 tokens placed per micro batch), with
    --attention-backend flash (the fused CPU kernel once per document in the ring's blocks)
    and with --cp-comm-type a2a."""
    masked = train(1, *DOCUMENT_FLAGS)
    close(train(2, "--context-parallel-size", "2", *DOCUMENT_FLAGS), masked)
    flash = ("--attention-backend", "flash")
    close(train(2, "--context-parallel-size", "2", *flash, *DOCUMENT_FLAGS), masked)
    dynamic = ("--cp-placement", "dynamic", "--cp-block-size", "2")
    close(train(2, "--context-parallel-size", "2", *dynamic, *DOCUMENT_FLAGS), masked)
    a2a = ("--cp-comm-type", "a2a")  # the whole sequence's document mask, half the heads
    close(train(2, "--context-parallel-size", "2", *a2a, *DOCUMENT_FLAGS), masked)
    assert all(abs(a - b) > 1e-4 for a, b in zip(masked, single))


def test_attention_dropout_at_cp2_is_reproducible_and_recomputed_alike(single):
    """Both --cp-comm-type variants: two runs give the same losses, and so does a run with
    recomputation (its gradients, hence its updates, are identical); dropout changes them."""
    full = ("full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
    for comm, recompute in (("p2p", ("selective",)), ("all_gather", full)):
        drop = (
            "--context-parallel-size",
            "2",
            "--cp-comm-type",
            comm,
            "--attention-dropout",
            "0.2",
        )
        first = train(2, *drop)
        changed = zip(first[1:], single[1:])  # at step 1 the small init's change is ~1e-6
        assert all(abs(a - b) > 1e-4 for a, b in changed), (comm, first, single)
        if comm == "p2p":
            assert train(2, *drop) == first
        assert train(2, *drop, "--recompute-granularity", *recompute) == first, comm
