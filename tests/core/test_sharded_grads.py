"""--data-parallel-sharding-strategy optim_grads (ZeRO-2): it trains like ZeRO-1, keeps only
numel / dp of gradients between micro batches, and its checkpoints load under ZeRO-1 and back.

Tolerances: ZeRO-1 sums a rank's 4 micro batches, then reduce-scatters once; ZeRO-2
reduce-scatters each micro batch and sums the 4 reduced parts. Both are fp32 sums of the same
8 terms in another order (the 1/dp scaling, 0.5, is exact), so gradients differ by a few ulps.
Adam divides each element by its own magnitude, which turns those ulps of a near-zero gradient
into weight differences up to about lr x 1e-4 a step (lr 1e-3 here): weights within 1e-6
absolute after 3 steps, losses within 1e-6 relative (as tests/core/test_distopt_instances.py
argues for its other summation order)."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megadyn.core.distributed import DistributedDataParallel, finalize_model_grads
from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.core.optimizer import OptimizerConfig, build_optimizer
from megadyn.testing import spawn
from megadyn.training.arguments import ConfigError, parse_args
from megadyn.training.trainer import Trainer
from tests.tiny import tiny_args
from tests.training.test_training_run import JOB

STEPS, MICRO = 3, 4
ARGS = tiny_args(
    JOB,
    use_distributed_optimizer=True,
    overlap_grad_reduce=True,
    lr="1e-3",
    min_lr="1e-4",
    train_iters=STEPS,
)  # global batch 4 x dp: 4 micro batches of 1 sample a rank


def _trainer(world, strategy, *flags, device="cpu"):
    tp = 2 if "--sequence-parallel" in flags else 1
    cp = 2 if "--context-parallel-size" in flags else 1
    argv = ARGS + ["--global-batch-size", str(MICRO * world // (tp * cp))]
    argv += ["--tensor-model-parallel-size", str(tp), *flags]
    argv += ["--data-parallel-sharding-strategy", strategy]
    cfg = parse_args(argv, world)
    backend = "gloo" if device == "cpu" else "nccl"
    groups = ParallelGroups.build(cfg.layout(world), range(world), backend=backend)
    return Trainer(cfg, groups, device, print_fn=lambda *a, **k: None)


def _watch(trainer) -> list[bool]:
    """After each backward's flush: whether every staging tensor was released."""
    released = []
    for ddp in trainer.ddp:
        staging = ddp._staging
        flush = staging.flush

        def checked(flush=flush, staging=staging):
            flush()
            released.append(all(b.staging is None for b in staging.buckets))

        staging.flush = checked
    return released


def _run(trainer):
    """(losses, weights after the last step, gradient norms) of STEPS steps."""
    losses, norms = [], []
    while trainer.state.iteration < STEPS:
        step = trainer.train_step()
        assert step.applied
        loss = torch.zeros(()) if step.loss is None else step.loss.float().cpu()
        dist.all_reduce(loss)
        losses.append(loss.item())
        norms.append(step.grad_norm)
    weights = [p.detach().float().clone() for c in trainer.chunks for p in c.parameters()]
    return losses, weights, norms


def _close(zero1, zero2) -> None:
    for a, b in zip(zero1[0], zero2[0]):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (zero1[0], zero2[0])
    for a, b in zip(zero1[1], zero2[1]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def _memory(trainer, released) -> None:
    """Only numel / dp of gradients persist; every micro batch staged each bucket once and
    released it at the end of its backward."""
    dp = trainer.groups.dp_size * trainer.groups.cp_size
    assert released == [True] * (STEPS * MICRO)
    for ddp in trainer.ddp:
        for buffer in ddp.buffers:
            assert buffer.grad_data is None
            assert buffer.grad_shard.numel() == buffer.numel // dp
            for bucket in buffer.buckets:
                assert bucket.staging is None and bucket.staged == STEPS * MICRO
        assert not any(hasattr(p, "main_grad") for p in ddp.module.parameters())


def _states(trainer):
    opt = trainer.optimizer
    return [opt.param_state(p) for p in opt.params]


def _states_close(got, want, exact: bool) -> None:
    for g, w in zip(got, want):
        for key in w:
            if exact:
                assert torch.equal(g[key], w[key]), key
            else:  # exp_avg_sq ~ grad^2: relative; main and exp_avg as the weights
                torch.testing.assert_close(g[key], w[key], rtol=1e-5, atol=1e-6)


def _cross_checkpoints(world, zero1, zero2, ckpt_dir) -> None:
    """A ZeRO-2 checkpoint loads under ZeRO-1 and a ZeRO-1 one under ZeRO-2, bit-exactly."""
    for trainer, name, other in ((zero2, "two", "optim"), (zero1, "one", "optim_grads")):
        path = os.path.join(ckpt_dir, name)
        trainer.cfg = _with_save(trainer.cfg, path)
        trainer.save()
        trainer.finish_saves()
        loaded = _trainer(world, other)
        loaded.load(os.path.join(path, f"iter_{STEPS:07d}"))
        assert loaded.optimizer.step_count == STEPS
        _states_close(_states(loaded), _states(trainer), exact=True)


def _with_save(cfg, path):
    import dataclasses

    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, save=path))


def _count_live(ddp) -> list[int]:
    """Each time a bucket stages: how many buckets hold a staging tensor then."""
    live, buckets = [], ddp._staging.buckets
    for bucket in buckets:
        stage = bucket.stage

        def counted(stage=stage):
            out = stage()
            live.append(sum(b.staging is not None for b in buckets))
            return out

        bucket.stage = counted
    return live


def _small_buckets(rank, world) -> None:
    """Many buckets, overlapped reduction, no_sync for all but the last micro batch: ZeRO-2
    launches each bucket in the backward, every micro batch, and matches ZeRO-1."""
    groups = ParallelGroups.build(Layout(dp=world), range(world))
    runs = {}
    for strategy in ("optim", "optim_grads"):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(7, 13), nn.LayerNorm(13), nn.GELU(), nn.Linear(13, 13), nn.GELU(),
            nn.Linear(13, 5),
        )  # fmt: skip
        ddp = DistributedDataParallel(
            model, groups.dp_group, overlap_grad_reduce=True, use_distributed_optimizer=True,
            bucket_size=16, data_parallel_sharding_strategy=strategy,
        )  # fmt: skip
        cfg = OptimizerConfig(lr=1e-2, clip_grad=0.05, use_distributed_optimizer=True)
        opt = build_optimizer([ddp], [ddp], groups, cfg)
        live = _count_live(ddp) if strategy == "optim_grads" else []
        norms = []
        for step in range(STEPS):
            opt.zero_grad()
            for micro in range(MICRO):
                g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
                x, y = torch.randn(2, 7, generator=g), torch.randn(2, 5, generator=g)
                with ddp.no_sync() if micro < MICRO - 1 else torch.enable_grad():
                    nn.functional.mse_loss(ddp(x), y).backward()
            finalize_model_grads([ddp], groups)
            norms.append(opt.step().grad_norm)
        runs[strategy] = (norms, [p.detach().clone() for p in model.parameters()], ddp)
    (norms1, weights1, _), (norms2, weights2, ddp) = runs["optim"], runs["optim_grads"]
    buckets = ddp.buffers[0].buckets
    assert len(buckets) == 4 and all(b.staged == STEPS * MICRO for b in buckets)
    assert max(live) <= 2 < len(buckets)  # the one reducing and the one filling
    torch.testing.assert_close(norms2, norms1, rtol=1e-6, atol=0)
    for a, b in zip(weights1, weights2):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    _after_a_failed_backward(ddp, buckets)


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom")


def _after_a_failed_backward(ddp, buckets) -> None:
    """A backward that raises after some hooks ran never runs its flush: zero_grad_buffer
    forgets it, and the next backward reduces and releases everything again."""
    x = torch.ones(2, 7, requires_grad=True)
    with pytest.raises(RuntimeError, match="boom"):
        ddp(_Boom.apply(x)).sum().backward()
    ddp.zero_grad_buffer()
    assert all(b.staging is None for b in buckets)
    ddp(torch.ones(2, 7)).sum().backward()
    assert all(b.staging is None and b.staged == STEPS * MICRO + 2 for b in buckets[:-1])
    assert buckets[-1].staging is None  # the first layer's: no gradient before the raise


def _dp2(rank, world, ckpt_dir):
    _small_buckets(rank, world)
    zero1 = _trainer(world, "optim")
    ref = _run(zero1)
    zero2 = _trainer(world, "optim_grads")
    released = _watch(zero2)
    _close(ref, _run(zero2))
    _memory(zero2, released)
    _states_close(_states(zero2), _states(zero1), exact=False)
    _cross_checkpoints(world, zero1, zero2, ckpt_dir)
    # bf16 weights: the layers add their weight gradients through main_grad_of (wgrad.py);
    # with remainders in place of the fp32 main weights; fp16 with its loss scaler
    for flags in (
        ["--bf16"],
        ["--bf16", "--use-precision-aware-optimizer"],
        ["--fp16", "--initial-loss-scale", "1024"],
    ):
        ref = _run(_trainer(world, "optim", *flags))
        zero2 = _trainer(world, "optim_grads", *flags)
        released = _watch(zero2)
        _close(ref, _run(zero2))
        _memory(zero2, released)


def test_zero2_trains_like_zero1_at_dp2_and_checkpoints_cross(tmp_path):
    spawn(_dp2, world=2, args=(str(tmp_path),), timeout_s=300)


def _tp2_sp_and_cp2(rank, world):
    """tp 2 with sequence parallelism (the norm gradients' tp all-reduce on the shards), and cp
    2 (the gradients sharded over dp x cp)."""
    for flags in (["--sequence-parallel"], ["--context-parallel-size", "2"]):
        ref = _run(_trainer(world, "optim", *flags))
        zero2 = _trainer(world, "optim_grads", *flags)
        released = _watch(zero2)
        _close(ref, _run(zero2))
        _memory(zero2, released)


def test_zero2_trains_like_zero1_at_dp2_tp2_sequence_parallel_and_dp2_cp2():
    spawn(_tp2_sp_and_cp2, world=4, timeout_s=300)


@pytest.mark.parametrize(
    "flags, world, message",
    [
        (["--overlap-grad-reduce"], 2, "needs --use-distributed-optimizer"),
        (["--use-distributed-optimizer"], 2, "needs --overlap-grad-reduce"),
        (["--use-distributed-optimizer", "--pipeline-model-parallel-size", "2"], 2,
         "--pipeline-model-parallel-size > 1"),
        (["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"], 4,
         "--num-distributed-optimizer-instances > 1"),
    ],
)  # fmt: skip
def test_argument_errors(flags, world, message):
    argv = tiny_args(train_iters=1) + flags + ["--data-parallel-sharding-strategy", "optim_grads"]
    argv += [] if flags == ["--use-distributed-optimizer"] else ["--overlap-grad-reduce"]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args(argv, world)


def test_cuda_graphs_are_accepted():
    """ZeRO-2 composes with --enable-cuda-graph (the capture is checked on GPUs:
    test_sharded_grads_gpu.py)."""
    argv = tiny_args(train_iters=1) + ["--use-distributed-optimizer", "--overlap-grad-reduce"]
    argv += ["--data-parallel-sharding-strategy", "optim_grads", "--enable-cuda-graph"]
    argv += ["--hidden-dropout", "0", "--attention-dropout", "0"]
    cfg = parse_args(argv, 2)
    assert cfg.training.enable_cuda_graph
    assert cfg.parallel.data_parallel_sharding_strategy == "optim_grads"


def test_unknown_strategy_and_default():
    with pytest.raises(ConfigError, match="data.parallel.sharding.strategy"):
        parse_args(tiny_args(train_iters=1) + ["--data-parallel-sharding-strategy", "x"], 2)
    cfg = parse_args(tiny_args(train_iters=1), 2)
    assert cfg.parallel.data_parallel_sharding_strategy == "optim"


def _bench(rank, world):
    from megadyn.bench.gpt import parse_args as bench_args
    from megadyn.bench.gpt import run_gpt_bench

    tiny = "--layers 2 --hidden 64 --heads 4 --seq 32 --vocab 256 --mbs 2 --gbs 8".split()
    flags = tiny + ["--iters", "1", "--warmup", "1", "--data-parallel-sharding-strategy"]
    return run_gpt_bench(bench_args(flags + ["optim_grads"]), torch.device("cpu"))


def test_the_benchmark_runs_and_records_the_strategy():
    record = spawn(_bench, world=2)[0]
    assert record["sharding_strategy"] == "optim_grads" and record["dp"] == 2
