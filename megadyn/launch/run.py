"""The run of one megadyn job on one rank: what pretrain_gpt.py (and a forked worker) executes.

    sys.exit(errors.run_reported(main))     # pretrain_gpt.py: one message per failure
    result = main(argv)                     # a RunResult (result.py); a test in a spawned process

`main` brings up the process group, parses the command line into a config for this world (a
restart may replan the layout: replan.py), starts this host's fork server and the heartbeats,
then `run`s the job. `run` trains on the job's first layout from the newest snapshot or --load
(snapshot_keeper.resume); with live reconfiguration on, the elastic controller moves processes
between training and standby at step boundaries, and a SIGTERM drains a process from the job
(preemption.py). The runtime gives each trainer its step hooks (`step_hooks`): the snapshot
schedule, the heartbeats and the controller (or --exit-signal-handler's check), in that order.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from megadyn.core.hetero_layout import HeteroLayout
from megadyn.elastic.control.channel import ControlChannel, connect
from megadyn.elastic.control.controller import ElasticController, Released
from megadyn.elastic.control.drain import DrainSignal, Stopped
from megadyn.elastic.planning.hetero_job import build_groups, job_members
from megadyn.elastic.recovery.agreement import PeerFailed, RecoveryError
from megadyn.launch import determinism, fork_server, preemption, rejoin, startup, torchrun_env
from megadyn.launch.distributed_init import init_distributed
from megadyn.launch.failure_watch import FailureWatch
from megadyn.launch.replan import config_for_world
from megadyn.launch.result import RunResult
from megadyn.launch.snapshot_keeper import SnapshotKeeper, resume, resume_snapshot
from megadyn.launch.watchdog import Watchdog
from megadyn.training.arguments import deterministic_mode, distributed_timeout, ignored_vocab_size
from megadyn.training.config import MegadynConfig
from megadyn.training.hetero_config import first_layout
from megadyn.training.state import TrainingState
from megadyn.training.trainer import Trainer

FAILURE_RECORD_WAIT_S = 10.0
"""After a collective raised: how long to wait for the agent to record a dead peer (it polls
its workers every --monitor-interval) before taking the error for another one."""
RECOVERY_EXIT = 76
"""Exit status of a survivor that cannot recover in-process."""
REJOIN_CONNECT_S = 60.0
"""How long a replacement host's worker tries to reach the survivors' control store."""
NCCL_ABORT_DEADLINE_S = 10.0
"""How long a survivor waits for its NCCL communicators' abort before it exits with
RECOVERY_EXIT (aborting every group at once returned in 0.53 s in scripts/gpu/nccl_abort_probe.py
on 2 x H200; a backstop for an abort that does not return, as aborting the groups one after
another did on torch 2.11)."""


def main(argv: list[str] | None = None) -> RunResult:
    """Run the job of command line `argv` on this rank: its losses by iteration (and, under
    live reconfiguration, the samples it drew and the events it took part in)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    startup.mark("python and imports")
    # seconds of imports that the start itself does not need: checkpoints (snapshots) and the
    # cross entropy's kernels, imported while the process group comes up and the model is built
    kernels = ["triton"] if torch.cuda.is_available() else []
    startup.import_beside("torch.distributed.checkpoint", *kernels)
    deterministic = determinism.enable() if deterministic_mode(argv) else None
    device = init_distributed(distributed_timeout(argv))
    startup.mark("process group")
    if deterministic and dist.get_rank() == 0:
        print(deterministic, flush=True)
    world = dist.get_world_size()
    if "--default-job" in argv:
        from megadyn.training.default_job import default_job_argv

        argv.remove("--default-job")
        argv = default_job_argv(argv, world, device.type == "cuda")
    cfg = config_for_world(  # a ConfigError ends the job with its message (errors.py)
        argv,
        world,
        restarted=bool(torchrun_env.current().restart_count),
        device_type=device.type,
        print_fn=print if dist.get_rank() == 0 else None,
    )
    if fork_server.FORKED not in os.environ:  # this host had none ready: for later attempts
        started = fork_server.start(enabled=cfg.elastic.fork_server)
        if started and dist.get_rank() == 0:
            print(
                " fork server: restarted workers fork from a pre-imported process on each host "
                "(--no-elastic-fork-server turns it off)",
                flush=True,
            )
    watchdog = Watchdog.start(cfg.elastic.heartbeat_timeout)  # under torchrun only
    watch = watch_failures(cfg, watchdog, device)
    try:
        result = run(cfg, device, watchdog=watchdog, failures=watch)
    finally:
        if watchdog is not None:
            watchdog.stop()
        if watch is not None:
            watch.stop()
    if watch is None or not watch.dead():  # else the default group has a dead member
        dist.destroy_process_group()
    fork_server.job_done()
    return result


def watch_failures(cfg: MegadynConfig, watchdog: Watchdog | None, device) -> FailureWatch | None:
    """Under `python -m megadyn.launch`, in elastic mode with --elastic-recovery in-process:
    declare that the survivors of a failure recover in-process and watch the agent's failure
    records (failure_watch.py); a hung rank is then killed by its watchers and recovered from
    like a dead one. On GPUs the watch aborts the NCCL communicators when a failure comes."""
    el = cfg.elastic
    if not (el.live and el.recovery == "in-process"):
        return None
    watch = FailureWatch.start(
        max(60.0, 2 * el.heartbeat_timeout),
        on_failure=watchdog.forget if watchdog is not None else None,
        abort_nccl=device.type == "cuda",
        abort_deadline_s=NCCL_ABORT_DEADLINE_S,
        abort_exit=RECOVERY_EXIT,
    )
    if watch is not None and watchdog is not None:
        watchdog.keep_going = True
        watch.on_revive = watchdog.remember  # a replacement host's processes (rejoin.py)
    return watch


def step_hooks(cfg: MegadynConfig, watchdog: Watchdog | None, last_hook=None) -> list:
    """The hooks the runtime gives a trainer, in the order they run at a step boundary: the
    snapshot schedule (--elastic-snapshot-interval), the heartbeats, and the elastic controller
    (or, without it, --exit-signal-handler's check)."""
    hooks = []
    if cfg.elastic.snapshot_interval:
        hooks.append(SnapshotKeeper(cfg.elastic.snapshot_interval))
    if watchdog is not None:
        hooks.append(watchdog.step_hook)
    if last_hook is not None:
        hooks.append(last_hook)
    return hooks


def start_line(world: int, members: int, layout, device) -> str:
    """The job's first line: its processes, how many of them the layout holds (the rest wait
    as standby processes), the layout and the device."""
    standby = world - members
    held = f" ({members} in the layout, {standby} standby)" if standby else ""
    return f" megadyn: {world} processes{held}, {layout_line(layout, device)}"


def layout_line(layout, device) -> str:
    """The start line's layout and device: degrees, or replicas (--heterogeneous-pipelines)."""
    if isinstance(layout, HeteroLayout):
        return f"device {device.type}, replicas of different pipeline depth:\n{layout.describe()}"
    return (
        f"layout tp={layout.tp} pp={layout.pp} dp={layout.dp} vpp={layout.vpp} "
        f"sequence_parallel={layout.sequence_parallel}, device {device.type}"
    )


def control_channel(
    cfg: MegadynConfig, rank: int = 0, host: str | None = None, connect_timeout_s=None
) -> ControlChannel:
    """The job's control store, hosted by rank 0 (--elastic-control-port, else torchrun's store
    port + 1), for the controller and tools/elastic_ctl.py; after rank 0 died, by process
    `rank` on `host` (the survivors' recovery), on the same port, reached within
    `connect_timeout_s` (the recovery's own time)."""
    env = torchrun_env.current()
    port = cfg.elastic.control_port or (env.master_port or 29500) + 1
    launcher_port = env.master_port if env.use_agent_store else None
    is_server = dist.get_rank() == rank
    address = (env.master_addr or "127.0.0.1") if host is None else host
    store = connect(
        address,
        port,
        is_server=is_server,
        launcher_port=launcher_port,
        connect_timeout_s=connect_timeout_s,
    )
    if host is None:
        dist.barrier()  # the server is up before anyone else uses the channel
    return ControlChannel(store)


def run(
    cfg: MegadynConfig,
    device,
    *,
    watchdog: Watchdog | None = None,
    failures: FailureWatch | None = None,
    print_fn=print,
) -> RunResult:
    """Train the job of `cfg` on this rank: this process's losses by iteration; with live
    reconfiguration also the sample indices it drew and the reconfiguration events it took
    part in (a standby process trains only after it joins; after a torchrun restart the
    members start under the job's first layout)."""
    controller, last_hook = None, None
    if preemption.install(cfg) and not cfg.elastic.live:  # --exit-signal-handler
        saves = bool(cfg.checkpoint.save)
        last_hook = preemption.ExitSignalHook(saves=saves)
    if cfg.elastic.live:

        def make_trainer(groups, training: dict, step_hook):  # a standby process joins
            state = TrainingState.from_dict(training).progress
            hooks = step_hooks(cfg, watchdog, step_hook)
            return Trainer(cfg, groups, device, state=state, init_weights=False, hooks=hooks)

        joining = rejoin.rejoin_epoch()  # a replacement host's worker (rejoin.py)
        info = rejoin.joined_info(joining) if joining else None
        if info is None:
            channel = control_channel(cfg)
        else:  # where the survivors' control store is now
            rank, host = info["control"]
            address = host or torchrun_env.current().master_addr or "127.0.0.1"
            channel = control_channel(cfg, rank, address, REJOIN_CONNECT_S)
        rejoins = None
        if failures is not None and torchrun_env.current().coordinator:  # replacement.py
            rejoins = rejoin.Rejoins(
                lambda: first_members(cfg, device), cfg.parallel.distributed_timeout
            )
        drain_signal = DrainSignal(received=preemption.received, end=preemption.end)
        controller = ElasticController(
            cfg,
            channel,
            device,
            make_trainer=make_trainer,
            print_fn=print_fn,
            drain_signal=drain_signal,
            failures=failures,
            resume=resume_snapshot,
            reconnect=lambda rank, host, timeout_s: control_channel(cfg, rank, host, timeout_s),
            rejoins=rejoins,
        )
        last_hook = controller.step_hook
        if info is not None:  # it waits as standby until the survivors' transition takes it
            controller.joined(info)
            return train_elastic(controller, None, failures)
    layout = first_layout(cfg, dist.get_world_size(), device.type)
    groups = build_groups(layout, job_members(layout, range(dist.get_world_size())),
                          timeout=cfg.parallel.distributed_timeout)  # fmt: skip
    if dist.get_rank() == 0:
        print(start_line(dist.get_world_size(), len(groups.grid.members), layout, device),
              flush=True)  # fmt: skip
        if ignored := ignored_vocab_size(cfg.data):
            print(ignored, flush=True)
    trainer = None
    if controller is not None:
        controller.members = list(groups.grid.members)
    if groups.is_member:  # the rest wait as standby processes of the controller
        hooks = step_hooks(cfg, watchdog, last_hook)
        with ThreadPoolExecutor(1, thread_name_prefix="megadyn-connect") as pool:
            connecting = pool.submit(groups.connect, device)  # beside the model build
            trainer = Trainer(cfg, groups, device, hooks=hooks)
            connecting.result()
        startup.mark("groups, communicators, data, model and optimizer")
        resume(trainer)
    if controller is None:
        try:
            trainer.train()
        except Stopped:  # --exit-signal-handler
            save_and_stop(trainer)
        for hook in hooks:  # the run is done: every host's snapshot dir goes
            if isinstance(hook, SnapshotKeeper):
                hook.drop(trainer)
        close(trainer)
        return RunResult(losses=dict(trainer.loss_by_iteration))
    return train_elastic(controller, trainer, failures)


def first_members(cfg: MegadynConfig, device) -> tuple[object, list[int]]:
    """The job's first layout over every process, and its members."""
    layout = first_layout(cfg, dist.get_world_size(), device.type)
    return layout, list(job_members(layout, range(dist.get_world_size())))


def train_elastic(
    controller: ElasticController, trainer: Trainer | None, watch: FailureWatch | None = None
) -> RunResult:
    """Train while the controller keeps this process a member (standby without `trainer`);
    `watch` (failure_watch.py) is told which trainer runs."""
    losses, samples = {}, []
    while True:
        if trainer is None:
            trainer = controller.standby()
            if trainer is None:
                break
        if watch is not None:
            watch.trainer = trainer
        failed = False
        try:
            trainer.train()
        except Stopped:  # a drain was refused under --exit-signal-handler: save and exit
            save_and_stop(trainer)
        except Released as e:
            losses.update(trainer.loss_by_iteration)
            samples += trainer.samples_drawn
            trainer = None
            if e.leave:
                break
            continue
        except PeerFailed:  # seen at a step boundary
            failed = True
        except RuntimeError:  # a collective with a dead (or recovering) peer
            if not controller.failed(timeout_s=FAILURE_RECORD_WAIT_S):
                raise
            failed = True
        if failed:  # outside the handler: the error's frames no longer hold the old groups
            losses.update(trainer.loss_by_iteration)
            trainer = recover_or_exit(controller, trainer)
            if trainer is not None:
                losses = {i: v for i, v in losses.items() if i <= trainer.iteration}
            continue
        losses.update(trainer.loss_by_iteration)
        samples += trainer.samples_drawn
        controller.finish(trainer)
        close(trainer)
        break
    controller.leave_control()
    return RunResult(losses, samples, [e.to_dict() for e in controller.events])


def recover_or_exit(controller: ElasticController, trainer: Trainer | None) -> Trainer | None:
    """The survivors' in-process recovery; when it cannot run, one line says why and this
    process exits, so that torchrun's restart path follows."""
    try:
        return controller.recover(trainer)
    except RecoveryError as e:
        dead = controller.failures.dead()
        if _first_to_say(controller.failures.store, f"cannot_recover/{sorted(dead)}"):
            print(
                f" elastic: the survivors of rank(s) {sorted(dead)} cannot recover in-process: "
                f"{e}; exiting so that torchrun's restart path runs (--max-restarts)",
                flush=True,
            )
        sys.stdout.flush()
        os._exit(RECOVERY_EXIT)  # the default group has a dead member: no teardown


def _first_to_say(store, key: str) -> bool:
    """Whether this survivor is the first to claim `key` in the agent's store (so one line
    is printed however many survivors meet the same error); True if the store does not
    answer: a line twice beats none."""
    try:
        return store.add(key, 1) == 1
    except Exception:  # noqa: BLE001 - the store's host is gone
        return True


def save_and_stop(trainer: Trainer) -> None:
    """The job stops at this step boundary (--exit-signal-handler): a checkpoint with --save."""
    if trainer.cfg.checkpoint.save:
        trainer.save()
    trainer.finish_saves()


def close(trainer: Trainer) -> None:
    """Free the trainer's CUDA graph, then its groups (NCCL waits for the graphs first)."""
    trainer.drop_cuda_graph()
    trainer.groups.destroy()
