"""A worker of tests/launch/test_launch_agent.py: three gloo processes under
`python -m megadyn.launch --nproc-per-node 3`. In the first attempt rank 1 SIGKILLs itself after a
barrier; the others find it gone in a collective, read who died from the agent's store
(megadyn/launch/failures.py), finish their sum among themselves and exit 0. A later attempt
(after a restart) runs whole.

    --no-declare        the workers never say that they recover in-process
    --survivors-fail    the survivors give up after reading who died (exit 69)
"""

import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from megadyn.launch import failures, torchrun_env
from megadyn.launch.distributed_init import agent_store, attempt_prefix


def main() -> int:
    env = torchrun_env.current()
    rank, world, attempt = env.rank, env.world_size, env.restart_count
    timeout = timedelta(seconds=30)
    store = dist.PrefixStore(attempt_prefix(attempt), agent_store(timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    if rank == 0 and "--no-declare" not in sys.argv:
        failures.declare_recovering(store)
    dist.barrier()  # the declaration is in the store before anyone dies
    nccl = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    print(
        f" worker {rank}: attempt {attempt}, keep_survivors={env.keep_survivors}, "
        f"TORCH_NCCL_ASYNC_ERROR_HANDLING={nccl}",
        flush=True,
    )
    total = torch.ones(1)
    if attempt == 0 and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt == 0:
        try:
            dist.all_reduce(total)
            raise AssertionError("an all-reduce with rank 1 gone succeeded")
        except RuntimeError as e:
            print(
                f" worker {rank}: lost a peer ({str(e).splitlines()[0].split('] ')[-1][:60]})",
                flush=True,
            )
        dead = failures.wait_for(store, world, timeout=10.0)
        said = "; ".join(f.describe() for f in dead.values())
        print(f" worker {rank}: the agent's store says: {said}", flush=True)
        if "--survivors-fail" in sys.argv:
            return 69
        survivors = [r for r in range(world) if r not in dead]
        group = dist.new_group(survivors, use_local_synchronization=True)
        total = torch.ones(1)
        dist.all_reduce(total, group=group)
    else:
        dist.all_reduce(total)
    print(f" worker {rank}: done, sum {total.item():g}", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # the default group has a dead member: no teardown through it
