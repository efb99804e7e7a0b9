"""Pretrain a GPT model with megadyn: `torchrun --nproc-per-node N pretrain_gpt.py <Megatron flags>`.

    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --num-layers 24 --hidden-size 2048 ... --mock-data
    torchrun --nproc-per-node 4 pretrain_gpt.py --default-job      # the README's main job
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a restarted worker may run in a child of the host's fork server
    from megadyn.training import fork_server, startup

    fork_server.hand_over(sys.argv[1:], startup.process_start_time())

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from megadyn.core.groups import ParallelGroups
from megadyn.training import errors, fork_server, startup
from megadyn.training.arguments import distributed_timeout
from megadyn.training.distributed_init import init_distributed, restart_count
from megadyn.training.replan import config_for_world
from megadyn.training.trainer import Trainer
from megadyn.training.watchdog import Watchdog


def main(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    startup.mark("python and imports")
    # seconds of imports that the start itself does not need: checkpoints (snapshots) and the
    # cross entropy's kernels, imported while the process group comes up and the model is built
    kernels = ["triton"] if torch.cuda.is_available() else []
    startup.import_beside("torch.distributed.checkpoint", *kernels)
    device = init_distributed(distributed_timeout(argv))
    startup.mark("process group")
    world = dist.get_world_size()
    if "--default-job" in argv:
        from megadyn.training.default_job import default_job_argv

        argv.remove("--default-job")
        argv = default_job_argv(argv, world, device.type == "cuda")
    restart = restart_count()
    cfg = config_for_world(  # a ConfigError ends the job with its message (errors.py)
        argv,
        world,
        restarted=bool(restart),
        device_type=device.type,
        print_fn=print if dist.get_rank() == 0 else None,
    )
    if cfg.parallel.elastic_fork_server and fork_server.FORKED not in os.environ:
        # this host had none ready: for the workers of later attempts
        if fork_server.start(__file__) and dist.get_rank() == 0:
            print(
                " fork server: restarted workers fork from a pre-imported process on each host "
                "(--no-elastic-fork-server turns it off)",
                flush=True,
            )
    watchdog = Watchdog.start(cfg.parallel.elastic_heartbeat_timeout)  # under torchrun only
    try:
        if cfg.parallel.elastic:
            from megadyn.training.elastic_runner import run_elastic

            result = run_elastic(cfg, device, watchdog=watchdog)
        else:
            result = train(cfg, device, watchdog)
    finally:
        if watchdog is not None:
            watchdog.stop()
    dist.destroy_process_group()
    return result


def train(cfg, device, watchdog: Watchdog | None) -> list[float]:
    """Train on a fixed layout from the newest snapshot or checkpoint; per-step losses."""
    world = dist.get_world_size()
    layout = cfg.layout(world)
    groups = ParallelGroups.build(
        layout, members=range(layout.world_size), timeout=cfg.parallel.distributed_timeout
    )
    if dist.get_rank() == 0:
        print(
            f" megadyn: {world} processes, layout tp={layout.tp} pp={layout.pp} dp={layout.dp} "
            f"vpp={layout.vpp} sequence_parallel={layout.sequence_parallel}, device {device.type}",
            flush=True,
        )
    with ThreadPoolExecutor(1, thread_name_prefix="megadyn-connect") as pool:
        connecting = pool.submit(groups.connect, device)  # beside the model build
        trainer = Trainer(cfg, groups, device, step_hook=watchdog.step_hook if watchdog else None)
        connecting.result()
    startup.mark("groups, communicators, data, model and optimizer")
    trainer.resume()
    history = trainer.train()
    trainer.drop_snapshots()  # the run is done: every host's snapshot dir goes
    trainer.drop_cuda_graph()
    groups.destroy()
    return history


if __name__ == "__main__":
    sys.exit(errors.run_reported(main))  # one message per failure; MEGADYN_DEBUG=1 for tracebacks
