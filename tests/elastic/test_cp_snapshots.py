"""In-memory snapshots under context parallelism: a cp 2 job that stops after its snapshot of
iteration 4 (as a killed job would, its snapshot dir kept) resumes from it at cp 2 and under
another layout (dp 2), with the uninterrupted cp 1 run's losses and every sample drawn once;
with attention dropout the resumed step draws the stopped run's masks."""

import re
import shutil
from collections import Counter

from megadyn.testing import spawn
from tests.training.test_training_run import COMMON, close, train

CP2 = ["--context-parallel-size", "2"]
GLOBAL_BATCH, ITERS = 4, 6  # COMMON's --global-batch-size and --train-iters
SNAPSHOT, STOP = 4, 5  # snapshots every 2 iterations; the first job ends after step 5
RESUMED = re.compile(r"recovery: resuming from the in-memory snapshot \S*iter_(\d+)")


def trained(rank, world, argv, iters=None, kept=None):
    """pretrain_gpt's trainer on this rank, resumed from the newest complete snapshot, trained
    to `iters` (None: --train-iters) without dropping its snapshots: (losses, the samples this
    rank drew before iteration `kept`, None: all)."""
    from megadyn.core.groups import ParallelGroups
    from megadyn.launch.run import step_hooks
    from megadyn.launch.snapshot_keeper import resume
    from megadyn.training.arguments import parse_args
    from megadyn.training.draws import draws_before
    from megadyn.training.trainer import Trainer

    cfg = parse_args(list(argv), world)
    groups = ParallelGroups.build(cfg.layout(world), members=range(world))
    trainer = Trainer(cfg, groups, "cpu", hooks=step_hooks(cfg, None))
    resume(trainer)
    trainer.train_iters = iters or trainer.train_iters
    losses = trainer.train()
    if kept is not None:  # the steps after the snapshot are lost with the job
        trainer.draws = draws_before(trainer.draws, kept * GLOBAL_BATCH)
    samples = trainer.samples_drawn
    groups.destroy()
    return losses, samples


def test_a_cp2_job_resumes_from_its_snapshot_at_cp2_and_at_dp2(tmp_path, capfd):
    single = train(1)
    first = ["--elastic-snapshot-interval", "2", "--elastic-snapshot-dir"]
    argv = COMMON + first + [str(tmp_path / "cp2")] + CP2
    stopped = spawn(trained, world=2, args=(argv, STOP, SNAPSHOT))
    close(stopped[-1][0], single[:STOP])  # cp 2 taking snapshots trains like cp 1
    shutil.copytree(tmp_path / "cp2", tmp_path / "dp2")
    for name, layout in (("cp2", CP2), ("dp2", [])):
        argv = COMMON + first + [str(tmp_path / name)] + layout
        resumed = spawn(trained, world=2, args=(argv,))
        assert RESUMED.findall(capfd.readouterr().out) == [f"{SNAPSHOT:07d}"], name
        close(resumed[-1][0], single[SNAPSHOT:])
        drawn = Counter(i for run in (stopped, resumed) for _, samples in run for i in samples)
        assert sorted(drawn) == list(range(GLOBAL_BATCH * ITERS)), (name, drawn)
        assert set(drawn.values()) == {1}, (name, drawn)


def test_a_cp2_job_with_attention_dropout_resumes_with_the_same_masks(tmp_path):
    """The tracker's stream, alike on the cp ranks, comes back from the snapshot: the resumed
    step 5 draws the stopped run's masks (its loss is the same to the bit)."""
    argv = COMMON + CP2 + ["--attention-dropout", "0.2", "--elastic-snapshot-interval", "2"]
    argv += ["--elastic-snapshot-dir", str(tmp_path)]
    stopped = spawn(trained, world=2, args=(argv, STOP))[-1][0]
    resumed = spawn(trained, world=2, args=(argv,))[-1][0]
    assert len(resumed) == ITERS - SNAPSHOT and resumed[0] == stopped[SNAPSHOT], (stopped, resumed)
