"""Learning-rate / weight-decay schedules and the micro-batch calculator, against closed forms."""

import dataclasses
import math

import pytest

from megadyn.core.optimizer import OptimizerConfig
from megadyn.training.config import ConfigError, SchedulerConfig, TrainingConfig
from megadyn.training.microbatches import MicroBatchCalculator
from megadyn.training.scheduler import LRScheduler
from tests.tiny import tiny_args

MAX, MIN, INIT, WARM, DECAY = 1e-3, 1e-4, 1e-5, 10, 110


def expected_lr(style: str, it: int) -> float:
    if it <= WARM:
        return INIT + (MAX - INIT) * it / WARM
    if style == "constant":
        return MAX
    if it > DECAY:
        return MIN
    ratio = (it - WARM) / (DECAY - WARM)
    coeff = 1 - ratio if style == "linear" else 0.5 * (1 + math.cos(math.pi * ratio))
    return MIN + coeff * (MAX - MIN)


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_lr_matches_closed_form(style):
    sched = LRScheduler(
        max_lr=MAX, min_lr=MIN, init_lr=INIT, warmup_steps=WARM, decay_steps=DECAY,
        decay_style=style,
    )  # fmt: skip
    seen = {}
    for it in range(DECAY + 20):
        seen[it] = sched.lr
        sched.step()
    for it in (0, 1, 5, WARM, WARM + 1, 35, 60, 85, DECAY - 1, DECAY, DECAY + 1, DECAY + 19):
        assert seen[it] == pytest.approx(expected_lr(style, it), rel=1e-12, abs=1e-15), it
    if style == "cosine":  # halfway through decay the cosine is at the midpoint
        assert seen[60] == pytest.approx((MAX + MIN) / 2)


def test_inverse_square_root_and_wsd():
    isr = LRScheduler(
        max_lr=1.0, warmup_steps=4, decay_steps=100, decay_style="inverse-square-root"
    )
    assert isr.lr_at(16) == pytest.approx(math.sqrt(4) / math.sqrt(16))
    wsd = LRScheduler(
        max_lr=1.0, min_lr=0.0, decay_steps=100, decay_style="WSD", wsd_decay_steps=20,
        wsd_decay_style="linear",
    )  # fmt: skip
    assert wsd.lr_at(80) == 1.0 and wsd.lr_at(90) == pytest.approx(0.5)


def test_weight_decay_increment_and_param_group_multipliers():
    groups = [{"params": []}, {"params": [], "lr_mult": 0.5, "wd_mult": 0.0}]
    opt = type("Opt", (), {"param_groups": groups})()
    calls = []
    sched = LRScheduler(
        max_lr=1.0, decay_steps=100, decay_style="constant", start_wd=0.0, end_wd=0.1,
        wd_incr_steps=100, wd_incr_style="linear", optimizer=opt,
        on_update=lambda lr, wd: calls.append((lr, wd)),
    )  # fmt: skip
    sched.step(25)
    assert groups[0]["lr"] == 1.0 and groups[1]["lr"] == 0.5
    assert groups[0]["weight_decay"] == pytest.approx(0.025) and groups[1]["weight_decay"] == 0.0
    assert calls[-1] == pytest.approx((1.0, 0.025))
    cos = LRScheduler(max_lr=1.0, decay_steps=10, start_wd=0.0, end_wd=0.1, wd_incr_steps=100,
                      wd_incr_style="cosine")  # fmt: skip
    assert cos.wd_at(50) == pytest.approx(0.05) and cos.wd_at(200) == 0.1


def test_from_config_resolves_megatron_defaults():
    cfg = SchedulerConfig(lr_decay_style="cosine", lr_warmup_fraction=0.1)
    opt = OptimizerConfig(lr=2e-4, min_lr=2e-5, weight_decay=0.1)
    sched = LRScheduler.from_config(cfg, opt, train_iters=200)
    assert sched.decay_steps == 200 and sched.warmup_steps == pytest.approx(20)
    assert sched.start_wd == sched.end_wd == 0.1 and sched.lr == 0.0
    with pytest.raises(ConfigError, match="^--lr-warmup-fraction"):
        LRScheduler.from_config(SchedulerConfig(lr_warmup_fraction=1.0), opt, train_iters=10)


def test_state_dict_round_trip():
    """A state continues where it was, with its own values (a rebuild under a new layout)."""
    make = dict(max_lr=1.0, min_lr=0.1, warmup_steps=5, decay_steps=50, decay_style="cosine")
    sched = LRScheduler(**make)
    sched.step(37)
    state = sched.state_dict()
    groups = [{"params": []}]
    restored = LRScheduler(**make, optimizer=type("Opt", (), {"param_groups": groups})())
    restored.load_state_dict(state, strict=True)
    assert restored.num_steps == 37 and restored.lr == sched.lr == groups[0]["lr"]
    restored.step()
    sched.step()
    assert restored.lr == sched.lr
    other = LRScheduler(**{**make, "decay_steps": 60})
    with pytest.raises(ConfigError, match="^--lr-decay-iters"):
        other.load_state_dict(state, strict=True)
    other.load_state_dict(state)
    assert other.decay_steps == 50 and other.num_steps == 37 and other.lr == sched.lr_at(37)


OPT = OptimizerConfig(lr=1e-2, min_lr=1e-3, weight_decay=0.1)


def test_resuming_another_schedule_needs_one_of_megatrons_flags():
    """Megatron's rule: a checkpoint's schedule that differs from the command line's is refused
    unless --override-opt_param-scheduler (the command line's) or
    --use-checkpoint-opt_param-scheduler (the checkpoint's) says which one goes on."""
    cfg = SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=2)
    saved = LRScheduler.from_config(cfg, OPT, train_iters=6)
    saved.step(3)
    state = saved.state_dict()
    same = LRScheduler.from_config(cfg, OPT, train_iters=6)
    assert same.resume_state(state, cfg) == state
    longer = LRScheduler.from_config(cfg, OPT, train_iters=8)
    with pytest.raises(ConfigError) as err:
        longer.resume_state(state, cfg)
    msg = str(err.value)
    assert msg.startswith("--train-iters: ") and "lr_decay_steps 6" in msg and "8" in msg, msg
    assert "--override-opt_param-scheduler" in msg, msg
    assert "--use-checkpoint-opt_param-scheduler" in msg, msg
    assert "wd_incr_steps" not in msg  # a constant weight decay does not use it
    override = dataclasses.replace(cfg, override_opt_param_scheduler=True)
    longer.load_state_dict(longer.resume_state(state, override))
    assert longer.decay_steps == 8 and longer.num_steps == 3
    keep = dataclasses.replace(cfg, use_checkpoint_opt_param_scheduler=True)
    longer = LRScheduler.from_config(keep, OPT, train_iters=8)
    longer.load_state_dict(longer.resume_state(state, keep))
    assert longer.decay_steps == 6 and longer.lr == saved.lr
    rebuilt = LRScheduler.from_config(keep, OPT, train_iters=8)  # a live reshard's rebuild
    rebuilt.load_state_dict(longer.state_dict())
    assert rebuilt.decay_steps == 6 and rebuilt.lr == saved.lr


@pytest.mark.parametrize(
    "change,flag",
    [
        (dict(lr=2e-2), "--lr"),
        (dict(min_lr=2e-3), "--min-lr"),
        (dict(lr_warmup_iters=3), "--lr-warmup-iters"),
        (dict(lr_warmup_fraction=0.5, lr_warmup_iters=0), "--lr-warmup-fraction"),
        (dict(lr_decay_iters=5), "--lr-decay-iters"),
        (dict(lr_decay_style="linear"), "--lr-decay-style"),
        (dict(lr_warmup_init=1e-4), "--lr-warmup-init"),
        (dict(weight_decay=0.2), "--weight-decay"),
    ],
)
def test_a_schedule_mismatch_names_its_flag(change, flag):
    cfg = SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=2)
    saved = LRScheduler.from_config(cfg, OPT, train_iters=6).state_dict()
    opt = {k: v for k, v in change.items() if k in ("lr", "min_lr", "weight_decay")}
    sched = {k: v for k, v in change.items() if k not in opt}
    other = LRScheduler.from_config(
        dataclasses.replace(cfg, **sched), dataclasses.replace(OPT, **opt), train_iters=6
    )
    with pytest.raises(ConfigError, match=f"^{flag}: "):
        other.resume_state(saved, cfg)


def test_megatrons_two_schedule_flags_are_exclusive():
    from megadyn.training.arguments import parse_args

    base = tiny_args(max_position_embeddings=None, train_iters=6)
    cfg = parse_args(base + ["--override-opt_param-scheduler"], world_size=1)
    assert cfg.scheduler.override_opt_param_scheduler
    with pytest.raises(ConfigError, match="--use-checkpoint-opt_param-scheduler"):
        parse_args(
            base + ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
            world_size=1,
        )


def test_rampup_micro_batches_sequence():
    mb = MicroBatchCalculator(micro_batch_size=2, final_global_batch_size=64, rampup=(16, 16, 3000))
    # 3 increments of 1000 samples each: 16 below 1000, 32 below 2000, 48 up to 3000, then 64
    consumed, sizes = 0, []
    while consumed < 4000:
        sizes.append(mb.global_batch_size(consumed))
        consumed += sizes[-1]
    assert sizes[:120] == [16] * 63 + [32] * 31 + [48] * 21 + [64] * 5
    assert [mb.global_batch_size(c) for c in (0, 999, 1000, 2999, 3000, 3001)] == [
        16, 16, 32, 48, 64, 64,
    ]  # fmt: skip
    # a pure function of (consumed samples, dp): dp may change mid-run
    assert [mb.num_micro_batches(0, dp) for dp in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert mb.num_micro_batches(5000, 4) == 8 and mb.num_micro_batches(5000, 2) == 16
    with pytest.raises(ConfigError, match="^--rampup-batch-size"):
        mb.num_micro_batches(0, 16)  # 16 samples over 16 ranks x 2
    with pytest.raises(ConfigError, match="^--global-batch-size"):
        mb.num_micro_batches(5000, 3)
    # Megatron's iteration count for --train-samples under ramp-up
    steps, used = 0, 0
    while used <= 3000:
        used += mb.global_batch_size(used)
        steps += 1
    assert mb.train_iterations(10_000) == steps + (10_000 - used) // 64


def test_constant_and_invalid_batch_settings():
    mb = MicroBatchCalculator.from_config(TrainingConfig(micro_batch_size=4, global_batch_size=32))
    assert mb.num_micro_batches(123, 2) == 4 and mb.batch_sizes() == [32]
    assert mb.train_iterations(1000) == 31
    with pytest.raises(ConfigError, match="^--rampup-batch-size"):
        MicroBatchCalculator(2, 64, (16, 10, 100))
    with pytest.raises(ConfigError, match="^--micro-batch-size"):
        MicroBatchCalculator(0, 64)


def test_drives_megadyns_optimizer_through_set_lr():
    class MixedPrecisionLike:  # megadyn.core.optimizer applies its groups' wd_mult itself
        def set_lr(self, lr):
            self.lr = lr

        def set_weight_decay(self, wd):
            self.wd = wd

    opt = MixedPrecisionLike()
    sched = LRScheduler(max_lr=1.0, warmup_steps=4, decay_steps=8, start_wd=0.1, end_wd=0.1)
    sched.bind(opt)
    assert opt.lr == 0.0 and opt.wd == 0.1
    sched.step(2)
    assert opt.lr == 0.5
