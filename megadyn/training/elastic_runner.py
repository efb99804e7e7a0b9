"""Run a job with live reconfiguration: members train, standby processes wait, the controller
moves processes between the two at step boundaries.

    result = run_elastic(cfg, device)     # what pretrain_gpt.py calls when elastic is on
"""

from __future__ import annotations

import os

import torch.distributed as dist

from megadyn.core.groups import ParallelGroups
from megadyn.elastic.control import ControlChannel, connect
from megadyn.elastic.controller import ElasticController, Released
from megadyn.training.state import TrainingState
from megadyn.training.trainer import Trainer


def control_channel(cfg) -> ControlChannel:
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = cfg.parallel.elastic_control_port or int(os.environ.get("MASTER_PORT", 29500)) + 1
    store = connect(host, port, is_server=dist.get_rank() == 0)
    dist.barrier()  # the server is up before anyone else uses the channel
    return ControlChannel(store)


def run_elastic(cfg, device, *, watchdog=None, print_fn=print) -> dict:
    """Train under the controller; returns this process's losses by iteration, the sample
    indices it drew and the reconfiguration events it took part in. After a torchrun restart
    the members start from the newest complete in-memory snapshot (else --load) under the
    job's first layout; `watchdog` (megadyn/training/watchdog.py) sees every step."""
    world = dist.get_world_size()

    def with_watchdog(step_hook):
        if watchdog is None:
            return step_hook

        def hook(trainer):
            watchdog.step_hook(trainer)
            step_hook(trainer)

        return hook

    def make_trainer(groups, training: dict, step_hook):
        return Trainer(
            cfg,
            groups,
            device,
            state=TrainingState.from_dict(training).progress,
            init_weights=False,
            step_hook=with_watchdog(step_hook),
        )

    controller = ElasticController(
        cfg, control_channel(cfg), device, make_trainer=make_trainer, print_fn=print_fn
    )
    layout = cfg.layout(world)
    groups = ParallelGroups.build(
        layout, members=range(layout.world_size), timeout=cfg.parallel.distributed_timeout
    )
    trainer = None
    if groups.is_member:
        trainer = Trainer(cfg, groups, device, step_hook=with_watchdog(controller.step_hook))
        trainer.resume()
    losses, samples = {}, []
    while True:
        if trainer is None:
            trainer = controller.standby()
            if trainer is None:
                break
        try:
            trainer.train()
        except Released as e:
            losses.update(trainer.loss_by_iteration)
            samples += trainer.samples_drawn
            trainer = None
            if e.leave:
                break
            continue
        losses.update(trainer.loss_by_iteration)
        samples += trainer.samples_drawn
        controller.finish(trainer)
        trainer.drop_cuda_graph()
        trainer.groups.destroy()
        break
    return {"losses": losses, "samples": samples, "events": controller.events}
