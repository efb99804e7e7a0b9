"""Kill one worker of a torchrun job and time the recovery: kill to the next completed step
(megadyn/bench/recovery.py, also `python -m megadyn.bench recovery`).

    python tools/bench_recovery.py --nproc 4 --kill-after 25 -- <pretrain_gpt.py flags>
    python tools/bench_recovery.py --in-process --nproc 2 --kill-after 25 -- <flags>
"""

from megadyn.bench.recovery import main

if __name__ == "__main__":
    main()
