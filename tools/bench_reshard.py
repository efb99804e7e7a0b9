"""Time live layout changes against the checkpoint path, on GPUs (one JSON line per change).

    torchrun --nproc-per-node 4 tools/bench_reshard.py --changes dp4 tp2xdp2 cp2xdp2 tp2xpp2 --ckpt-dir /tmp/ck

Trains the 1.42 B reference model (bf16, distributed optimizer, mock data) under tp2 x pp2, then
for each change: saves a torch.distributed.checkpoint of the whole training state (timed), changes
the layout live through the elastic controller (timed by phase), runs a step under the new layout,
and loads the checkpoint into the new layout (timed), so that live and checkpoint paths are
measured on the same state and cards. Also measures point-to-point bandwidth between two GPUs
(megadyn/bench/reshard.py; also `python -m megadyn.bench reshard`).
"""

from megadyn.bench.reshard import main

if __name__ == "__main__":
    main()
