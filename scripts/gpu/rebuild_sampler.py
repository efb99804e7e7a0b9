"""pretrain_gpt.py with a sampler of the main thread's stack during each live change's rebuild.

    SAMPLES_DIR=/tmp/s torchrun --nproc-per-node 2 scripts/gpu/rebuild_sampler.py <pretrain flags>

Each rank writes SAMPLES_DIR/r<rank>_rebuild<n>.txt per live change: the rebuild's wall time
(CUDA synchronized) and its 25 most frequent stacks, sampled every 4 ms; and
r<rank>_after<n>.txt: the same for what follows the rebuild up to the next step hook (the rest of
the change and the new layout's first step). Time spent inside a C++
call shows under the Python line that made it, where cProfile showed nothing (the rebuild's
1.64 s in NCCL group destruction, BENCHMARKS.md, eighth session). Run from the tree to measure;
it wraps the transition's REBUILD phase of that tree's megadyn (megadyn/elastic/transition.py's
`rebuild`; ElasticController._rebuild in trees before the transition).
"""

import collections
import os
import runpy
import sys
import threading
import time
import traceback

import torch

try:
    import megadyn.elastic.control.controller as controller
except ImportError:  # a tree before elastic's subpackages
    import megadyn.elastic.controller as controller

try:
    import megadyn.elastic.transition as transition
except ImportError:  # a tree before the transition: the controller rebuilt
    transition = None

OUT = os.environ["SAMPLES_DIR"]
RANK = int(os.environ.get("RANK", 0))
MAIN = threading.main_thread().ident
_owner = controller.ElasticController if transition is None else transition
_name = "_rebuild" if transition is None else "rebuild"
_rebuild = getattr(_owner, _name)
_changes = iter(range(1 << 30))


def _sample(stop: threading.Event, counts: collections.Counter) -> None:
    while not stop.is_set():
        frame = sys._current_frames().get(MAIN)
        if frame is not None:
            stack = reversed(traceback.extract_stack(frame)[-14:])
            counts[
                " <- ".join(f"{os.path.basename(s.filename)}:{s.lineno}:{s.name}" for s in stack)
            ] += 1
        time.sleep(0.004)


_step_hook = controller.ElasticController.step_hook
_after: list = []  # the sampling of what follows the last rebuild: (name, stop, counts, thread, start)


def _start(name: str) -> tuple:
    stop, counts = threading.Event(), collections.Counter()
    sampler = threading.Thread(target=_sample, args=(stop, counts), daemon=True)
    sampler.start()
    return name, stop, counts, sampler, time.perf_counter()


def _finish(name, stop, counts, sampler, start) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    stop.set()
    sampler.join()
    with open(os.path.join(OUT, f"r{RANK}_{name}.txt"), "w") as f:
        f.write(f"wall {wall:.3f} s, {sum(counts.values())} samples\n")
        f.writelines(f"{n:5d} {stack}\n" for stack, n in counts.most_common(25))


def sampled_rebuild(*args, **kwargs):
    n = next(_changes)
    sampling = _start(f"rebuild{n}")
    try:
        return _rebuild(*args, **kwargs)
    finally:
        _finish(*sampling)
        _after.append(_start(f"after{n}"))


def sampled_step_hook(self, trainer):
    while _after:
        _finish(*_after.pop())
    return _step_hook(self, trainer)


setattr(_owner, _name, sampled_rebuild)
controller.ElasticController.step_hook = sampled_step_hook
os.makedirs(OUT, exist_ok=True)
sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
runpy.run_path("pretrain_gpt.py", run_name="__main__")
