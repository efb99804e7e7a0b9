"""Iterations whose gradient norm is not finite are counted, logged and kept in the training
state that checkpoints and live reshards carry."""

from test_training_run import COMMON  # noqa: E402

from megadyn.testing import spawn


def poisoned_run(rank, world, argv):
    import torch

    from megadyn.core.groups import ParallelGroups
    from megadyn.training.arguments import parse_args
    from megadyn.training.trainer import Trainer

    cfg = parse_args(argv, world_size=world)
    groups = ParallelGroups.build(cfg.layout(world), range(world))
    lines = []

    def poison(trainer):  # a NaN weight after iteration 2: every later gradient norm is NaN
        if trainer.iteration == 2:
            with torch.no_grad():
                next(trainer.chunks[0].parameters()).view(-1)[0] = float("nan")

    trainer = Trainer(cfg, groups, "cpu", hooks=[poison], print_fn=lambda s, **k: lines.append(s))
    trainer.train()
    groups.destroy()
    return trainer.training_state().to_dict()["state"], lines


def test_nan_iterations_are_counted():
    state, lines = spawn(poisoned_run, world=1, args=(COMMON,))[0]
    assert state["iteration"] == 6 and state["nan_iterations"] == 4, state
    logged = [line for line in lines if "number of nan iterations" in line]
    assert "number of nan iterations:   0" in logged[1] and "nan iterations:   4" in logged[-1]
