"""Can a survivor abort NCCL communicators that wait on a killed peer, and go on?

    TORCH_NCCL_ASYNC_ERROR_HANDLING=0 NCCL_NVLS_ENABLE=0 python scripts/gpu/nccl_abort_probe.py VARIANT [plain|side]

On 2 GPUs: two processes, two NCCL groups, a `.item()` behind their all-reduces (the reduce on
the compute stream, or on a side stream with `side`); rank 1 SIGKILLs itself at step 30 and
rank 0's watch thread aborts the groups by VARIANT:
    seq              group.abort() one group after another
    grouped          the same inside one NCCL group call
    threads          every group at once, one thread each (megadyn/launch/failure_watch.py)
    backend_threads  the same on the groups' NCCL backends
    world            torch's _abort_process_group() (every group, the default one too)
then its main thread builds a new group and runs a step. It prints how long the abort took, or
"HUNG" and a `py-spy dump --native` of rank 0 (py-spy on PATH) after PROBE_WAIT seconds.
On 2 x H200 with torch 2.11 and NCCL 2.28.9 only `threads` returned (0.53 s; BENCHMARKS.md,
issue 20; the new group's step after it was added since and has not run on a GPU yet): run it
again when torch or NCCL changes.
"""

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def abort_groups(variant, groups):
    c10d = dist.distributed_c10d
    if variant == "seq":
        for g in groups:
            g.abort()
    elif variant == "grouped":
        b = groups[0]._get_backend(torch.device("cuda"))
        b._group_start()
        for g in groups:
            g.abort()
        b._group_end()
    elif variant == "threads":
        ts = [threading.Thread(target=g.abort) for g in groups]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    elif variant == "world":
        c10d._abort_process_group()  # every group, the default one too
    elif variant == "backend_threads":
        bs = [g._get_backend(torch.device("cuda")) for g in groups]
        ts = [threading.Thread(target=b.abort) for b in bs]
        for t in ts:
            t.start()
        for t in ts:
            t.join()


def worker(rank, variant, port, mode):
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "nccl",
        store=dist.PrefixStore("a/", store),
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    store.set(f"pid{rank}", str(os.getpid()))
    a = dist.new_group([0, 1])
    b = dist.new_group([0, 1])
    side = torch.cuda.Stream()
    x = torch.randn(4096, 4096, device="cuda")
    done = {}
    if rank == 0:
        peer = int(store.get("pid1"))

        def watch():
            while True:
                time.sleep(0.05)
                try:
                    with open(f"/proc/{peer}/stat") as f:
                        if f.read().split(")")[-1].split()[0] in "ZX":
                            break
                except FileNotFoundError:
                    break
            t0 = time.perf_counter()
            done["dead"] = t0
            print(f"[{variant}] peer dead; aborting", flush=True)
            abort_groups(variant, [a, b])
            print(f"[{variant}] abort returned in {time.perf_counter() - t0:.3f} s", flush=True)
            done["aborted"] = time.perf_counter()

        threading.Thread(target=watch, daemon=True).start()
    step = 0
    while "aborted" not in done:
        try:  # after the abort a collective on an aborted group raises: the loop ends
            y = x @ x
            if mode == "side":  # the reduce on a side stream, like a bucketed grad reduce
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    dist.all_reduce(y, group=a)
                torch.cuda.current_stream().wait_stream(side)
            else:
                dist.all_reduce(y, group=a)
            n = y.norm().reshape(1)
            dist.all_reduce(n, group=b)
            n.item()
        except Exception as e:  # noqa: BLE001
            print(
                f"[{variant}] rank {rank} step {step} raised {type(e).__name__}"[:300], flush=True
            )
            break
        step += 1
        if rank == 1 and step == 30:
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        while "aborted" not in done:
            time.sleep(0.01)
        print(f"[{variant}] main thread free at step {step}", flush=True)
        t1 = time.perf_counter()
        for g in (a, b):
            try:
                dist.destroy_process_group(g)
            except Exception as e:  # noqa: BLE001
                print(f"[{variant}] destroy raised {e}"[:200], flush=True)
        if variant == "world":
            dist.destroy_process_group()
            store2 = dist.PrefixStore("b/", store)
            dist.init_process_group("nccl", store=store2, rank=0, world_size=1)
            g = None
        else:
            g = dist.new_group([0], use_local_synchronization=True)
        z = torch.ones(1, device="cuda")
        dist.all_reduce(z, group=g)
        y = (x @ x).norm().item()
        print(
            f"[{variant}] RECOVERED: new group works ({z.item()}), matmul ok; "
            f"dead->aborted {done['aborted'] - done['dead']:.3f} s, rebuild {time.perf_counter() - t1:.3f} s",
            flush=True,
        )
        os._exit(0)


if __name__ == "__main__":
    variant = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "plain"
    port = 29700 + hash((variant, mode)) % 200
    ctx = mp.start_processes(
        worker, args=(variant, port, mode), nprocs=2, join=False, start_method="spawn"
    )
    first = ctx.processes[0]
    first.join(timeout=float(os.environ.get("PROBE_WAIT", "40")))
    if first.is_alive():
        import subprocess

        print(f"[{variant}] HUNG; py-spy of rank 0:", flush=True)
        subprocess.run(["py-spy", "dump", "--native", "--pid", str(first.pid)], timeout=60)
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        sys.exit(1)
    print(f"[{variant}] rank 0 exit code {first.exitcode}", flush=True)
