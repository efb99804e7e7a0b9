"""torchrun's elastic agent, keeping survivors: what `python -m megadyn.launch` runs.

    launch(args, keep_survivors=True)     # args: torch.distributed.run's parsed command line

torchrun's LocalElasticAgent polls its workers every --monitor-interval; when one has failed it
stops every other local worker (SIGTERM, then SIGKILL after the shutdown timeout) and restarts
the group while --max-restarts allows, else fails the job. `SurvivorKeepingAgent` changes one
thing: a worker that exits non-zero or is killed by a signal while other workers of its group
still run, in an attempt whose workers declared that they recover in-process
(failures.declare_recovering), is recorded in the store the workers reach at
MASTER_ADDR:MASTER_PORT (`failed/<global rank>` in the attempt's key space: failures.py), logged
in one line, and the others keep running. When the last worker has exited the group succeeded
if the ones that exited last all exited 0 (a summary line lists the failures survived); if any
of them failed, torchrun's own path follows: restart the group while --max-restarts allows,
else fail with torchrun's summary, whose root cause is the first failure. An agent whose
workers all failed has no survivor to keep and takes torchrun's path, which restarts the
workers of every host (their agents see it waiting in the next rendezvous), even where the
workers of other hosts could have gone on.

Hosts are the unit of failure too (hosts.py): once the attempt's workers recover in-process,
each agent writes a keep-alive into the same store every half second and watches the other
agents'; an agent silent for longer than --host-timeout is declared lost (by the first agent
that sees it), its workers are recorded as failed, and the survivors on the other hosts
recover in-process. Served by `python -m megadyn.launch.coordinator`, that store outlives every
training host, the one of rank 0 included. An agent that finds its own host declared lost
stops its workers and leaves (exit code 3): processes of the old epoch never rejoin. After a
lost host the exit barrier does not wait for its agent.

The coordinator may restart (coordinator.py): the agent's clients of its store reconnect
(store_client.py), the rendezvous survives it (rendezvous.py: one line when the coordinator
stops answering, one when it is back), and when it is back this agent publishes its failure
records again (with any it could not write meanwhile) and its host watch resumes
(`HostWatch.resume`).

Everything else is torchrun's own code: the command line (torch.distributed.run's parser and
`run`), the rendezvous, the workers' start, environment and logs, restarts, the exit barrier
and the summary. `launch` hands this agent class to torch.distributed.launcher.api's
`launch_agent` (which builds a LocalElasticAgent by that module's name) for the duration of
the run. Workers started as Python functions (--run-path) keep torchrun's behaviour: only
worker processes (torchrun's SubprocessContext) are polled one by one here, once per monitor
interval, and that one poll decides: in an attempt whose workers recover in-process the agent
never lets torchrun's monitor poll them again after its store work (a worker dying in between
would be torchrun's failure, the others stopped); it takes torchrun's monitor only where it
keeps no survivor. Once an attempt kept survivors its monitoring is this class's alone:
torchrun's check for workers stuck in uninterruptible sleep (in newer torch versions) no longer
runs for that attempt.
"""

from __future__ import annotations

import signal
import socket
import time
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.launcher.api as launcher_api
import torch.distributed.run as torchrun
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.utils.logging import get_logger

from megadyn.launch import failures, hosts, rendezvous, torchrun_env
from megadyn.launch.distributed_init import attempt_prefix
from megadyn.launch.store_client import CoordinatorDown, ReconnectingStore

KEEP_SURVIVORS_ENV = "MEGADYN_KEEP_SURVIVORS"
"""1 in the workers' environment when the agent keeps survivors (torchrun_env.keep_survivors);
0 in the launcher's environment turns the behaviour off, as --no-keep-survivors does."""
STORE_TIMEOUT = timedelta(seconds=10)
FENCED_EXIT = 3
"""The agent's exit code when another agent declared its host lost (hosts.py)."""
logger = get_logger(__name__)


def launch(
    args,
    keep_survivors: bool = True,
    host_timeout_s: float = 5.0,
    coordinator: tuple[str, int] | None = None,
) -> None:
    """Run torchrun's launcher on `args` (torch.distributed.run's parsed command line), with
    `SurvivorKeepingAgent` as its agent when `keep_survivors` (another agent silent for
    `host_timeout_s` seconds is a lost host; 0: hosts are not watched; `coordinator`: the
    (host, port) of `python -m megadyn.launch.coordinator`, whose store the workers use);
    otherwise torchrun exactly."""
    if not keep_survivors:
        torchrun.run(args)
        return
    settings = {"host_timeout_s": host_timeout_s, "coordinator": coordinator}
    if coordinator is not None:
        rendezvous.register()  # --rdzv-backend megadyn (__main__.py)
    with _agent_class(type("SurvivorKeepingAgent", (SurvivorKeepingAgent,), settings)):
        torchrun.run(args)


@contextmanager
def _agent_class(cls):
    """torch.distributed.launcher.api.launch_agent builds its agent as `LocalElasticAgent(...)`,
    read from its module: `cls` takes that name while the launcher runs."""
    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = cls
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original


class SurvivorKeepingAgent(LocalElasticAgent):
    """torchrun's agent, except that a worker's failure leaves the others of its group running
    when the attempt's workers recover in-process (module docstring)."""

    host_timeout_s = 5.0
    """Seconds without another agent's keep-alive before its host counts as lost (0: off)."""
    coordinator: tuple[str, int] | None = None
    """The store served apart from the training hosts (coordinator.py), or None."""

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """torchrun's rendezvous; with a coordinator, the workers' store (MASTER_ADDR and
        MASTER_PORT) is the coordinator's instead of one that node rank 0's agent serves, so
        that it outlives any training host."""
        super()._rendezvous(worker_group)
        if self.coordinator is not None:
            worker_group.master_addr, worker_group.master_port = self.coordinator

    def _start_workers(self, worker_group: WorkerGroup):
        spec = worker_group.spec
        self._attempt = spec.max_restarts - self._remaining_restarts  # TORCHELASTIC_RESTART_COUNT
        self._kept: dict[int, ProcessFailure] = {}  # local rank -> its failure, this attempt
        self._records = None  # the failure store of this attempt, connected at the first failure
        self._client: ReconnectingStore | None = None  # under it, with a coordinator
        self._made: list[failures.WorkerFailure] = []  # the records this agent made
        self._recovering = False  # the attempt's workers declared that they recover in-process
        self._hosts: hosts.HostWatch | None = None  # keep-alives, once they recover in-process
        self._store_silent = False  # the store did not answer the last keep-alive
        return super()._start_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        pcontext = self._pcontext
        if not isinstance(pcontext, SubprocessContext):  # Python functions: torchrun's way
            return super()._monitor_workers(worker_group)
        exits = {lr: h.proc.poll() for lr, h in pcontext.subprocess_handlers.items()}
        running = [lr for lr, code in exits.items() if code is None]
        self._reach_coordinator()
        self._watch_hosts(worker_group, running)
        new = [lr for lr, code in exits.items() if code not in (None, 0) and lr not in self._kept]
        if not self._kept and not (running and self._survivors_recover(worker_group)):
            # torchrun's decision, as before: its monitor polls again, and a worker that died
            # since `exits` is its failure (unless every worker had exited: nothing changes)
            return super()._monitor_workers(worker_group)
        if not running:  # the last workers exited
            return self._group_result(worker_group, exits, new)
        for local_rank in new:
            self._keep(worker_group, local_rank, exits[local_rank], len(running))
        if not self._kept:  # nothing failed: torchrun's result for running workers, from `exits`
            return self._running_result(worker_group)
        return RunResult(state=WorkerState.HEALTHY)

    def _running_result(self, worker_group: WorkerGroup) -> RunResult:
        """torchrun's result for workers that all still run, without polling them again:
        HEALTHY, unless (in torch versions that check it) one has been in uninterruptible
        sleep for longer than the agent's timeout."""
        timeout = getattr(self, "_uninterruptible_state_timeout", 0)
        if timeout > 0:
            result = self._check_uninterruptible_state_timeout(worker_group, timeout)
            if result is not None:
                return result
        return RunResult(state=WorkerState.HEALTHY)

    def _survivors_recover(self, worker_group: WorkerGroup) -> bool:
        """Whether the workers of this attempt declared that they recover in-process."""
        if self._recovering:
            return True
        try:
            store = self._failure_store(worker_group)
            self._recovering = store is not None and failures.recovering(store)
        except Exception as e:  # noqa: BLE001 - no store to record in: torchrun's path
            logger.warning("the agent's store did not answer (%s): stopping the workers", e)
        return self._recovering

    def _watch_hosts(self, worker_group: WorkerGroup, running: list[int]) -> None:
        """This agent's keep-alive and its watch over the other hosts (hosts.py), once the
        attempt's workers recover in-process; a fenced host's agent stops its workers and
        leaves."""
        if self.host_timeout_s <= 0:
            return
        if self._hosts is None:
            if not self._survivors_recover(worker_group):
                return
            pids = self._pcontext.pids()
            ranks = {worker_group.workers[lr].global_rank: pid for lr, pid in pids.items()}
            self._hosts = hosts.HostWatch(
                self._records,
                worker_group.group_rank,
                torchrun_env.host_identity(),
                ranks,
                self.host_timeout_s,
                log=logger.warning,
            )
        alive = {worker_group.workers[lr].global_rank for lr in running}
        try:
            self._hosts.tick(worker_group.group_world_size, alive)
            self._store_silent = False
        except hosts.Fenced as e:
            logger.error(
                "megadyn.launch: another agent declared this host (node rank %s) lost: %s; "
                "its workers are stopped and it leaves the job",
                worker_group.group_rank,
                e,
            )
            self._pcontext.close(death_sig=signal.SIGKILL)
            raise SystemExit(FENCED_EXIT) from None
        except CoordinatorDown:  # the rendezvous says so, once
            pass
        except Exception as e:  # noqa: BLE001 - the store is away: one line per outage
            if not self._store_silent:
                logger.warning(
                    "megadyn.launch: the job's store did not take the keep-alive (%s)", e
                )
            self._store_silent = True

    def _exit_barrier(self):
        """torchrun's barrier of every agent at the end, unless a host was lost (its agent
        would never arrive: the barrier would wait out its whole timeout)."""
        if self._hosts is not None and self._hosts.any_lost(self._worker_group.group_world_size):
            logger.warning(
                "megadyn.launch: a host was lost: not waiting for every agent at the exit"
            )
            return
        super()._exit_barrier()

    def _failure_store(self, worker_group: WorkerGroup):
        """A client of the store the workers reach at MASTER_ADDR:MASTER_PORT, in the attempt's
        key space; None when that store is a worker's (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1),
        since it would go with that worker."""
        if self._records is None and worker_group.spec.rdzv_handler.use_agent_store:
            where = (worker_group.master_addr, worker_group.master_port)
            if self.coordinator is None:
                client = dist.TCPStore(*where, is_master=False, timeout=STORE_TIMEOUT)
            else:  # it may restart: calls fail at once while it is down, then reconnect
                client = self._client = ReconnectingStore(*where, STORE_TIMEOUT, wait_s=0)
                client.on_reconnect.append(self._coordinator_back)
            self._records = dist.PrefixStore(attempt_prefix(self._attempt), client)
        return self._records

    def _reach_coordinator(self) -> None:
        """While the coordinator is down, look for it every monitor interval, so that the
        failure records are published again even when no host watch calls the store."""
        if self._client is not None and self._client.down_since is not None:
            try:
                self._client.check([failures.COUNT_KEY])
            except CoordinatorDown:
                pass

    def _coordinator_back(self) -> None:
        """The coordinator came back with an empty store: this agent's failure records again
        (the workers read them from a count of 0), and the host watch resumes."""
        for record in self._made:
            failures.record(self._records, record)
        if self._hosts is not None:
            self._hosts.resume()

    def _keep(self, worker_group: WorkerGroup, local_rank: int, code: int, running: int):
        """Record the failure of `local_rank` (exit status `code`) and log it; `running`
        workers of this agent go on."""
        failure = self._process_failure(local_rank, code)
        self._kept[local_rank] = failure
        record = self._record(worker_group, local_rank, failure, seen=time.time())
        self._made.append(record)
        try:
            failures.record(self._records, record)
        except CoordinatorDown:
            logger.warning(
                "megadyn.launch: the coordinator does not answer: the failure is recorded once "
                "it is back (the survivors wait for it)"
            )
        except Exception as e:  # noqa: BLE001 - the store went with its host: still keep going
            logger.warning("megadyn.launch: could not record the failure in the store (%s)", e)
        logger.warning(
            "megadyn.launch: %s; %d worker(s) of this agent keep running (recorded under %s%s "
            "in the agent's store)",
            record.describe(),
            running,
            attempt_prefix(self._attempt),
            failures.failed_key(record.rank),
        )

    def _process_failure(self, local_rank: int, code: int) -> ProcessFailure:
        """torchrun's record of a failed worker process (its error file read, if it wrote one)."""
        return ProcessFailure(
            local_rank=local_rank,
            pid=self._pcontext.pids()[local_rank],
            exitcode=code,
            error_file=self._pcontext.error_files[local_rank],
        )

    def _group_result(self, worker_group: WorkerGroup, exits: dict, last_failed: list):
        """Every worker has exited, survivors kept before: succeeded when the last ones to exit
        (those not recorded as failed while others ran) exited 0; else torchrun's FAILED, with
        every failure of the attempt by global rank (the first one is the summary's root cause)
        so that the agent restarts the group or fails the job."""
        workers = worker_group.workers
        describe = lambda lr, f: self._record(worker_group, lr, f).describe()  # noqa: E731
        kept = [describe(lr, f) for lr, f in sorted(self._kept.items())]
        if not last_failed:
            logger.warning(
                "megadyn.launch: the worker group finished; failures survived: %s", "; ".join(kept)
            )
            return RunResult(
                state=WorkerState.SUCCEEDED,
                return_values={w.global_rank: None for w in workers},
            )
        every = dict(self._kept)
        every.update({lr: self._process_failure(lr, exits[lr]) for lr in last_failed})
        first = min(every.values(), key=lambda f: f.timestamp)
        logger.error(
            "megadyn.launch: the survivors failed too (%s) after %s: the worker group failed "
            "(first failure: exitcode %s, local_rank %s, pid %s)",
            ", ".join(describe(lr, every[lr]) for lr in last_failed),
            "; ".join(kept),
            first.exitcode,
            first.local_rank,
            first.pid,
        )
        return RunResult(
            state=WorkerState.FAILED,
            failures={workers[lr].global_rank: f for lr, f in every.items()},
        )

    @staticmethod
    def _record(worker_group: WorkerGroup, local_rank: int, failure: ProcessFailure, seen=None):
        """The failure record (and its one description) of worker `local_rank`, seen gone at
        wall time `seen` (default: torchrun's whole second)."""
        return failures.WorkerFailure(
            rank=worker_group.workers[local_rank].global_rank,
            local_rank=local_rank,
            group_rank=worker_group.group_rank,
            host=socket.gethostname(),
            pid=failure.pid,
            exitcode=failure.exitcode,
            time=failure.timestamp if seen is None else seen,
        )
