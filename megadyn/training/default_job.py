"""The README's main job: a small GPT trained on text built on this machine.

The corpus is the Python standard library's docstrings (present wherever Python is), tokenized
by a SentencePiece model that megadyn's own tools train, through megadyn's own preprocessing
(megadyn.data.prepare_default_data). With 4 or more processes the layout is tp 2 x pp 2 (and dp
over the rest); the same command uses GPUs when there are some.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from megadyn.data import prepare_default_data


def default_job_argv(
    extra: list[str], world_size: int, on_gpu: bool, run_dir: str = "runs/default"
) -> list[str]:
    """Command-line flags of the default job (`extra` flags come last and win)."""
    data_dir = os.path.join(run_dir, "data")
    if dist.get_rank() == 0:
        paths = prepare_default_data(data_dir)
    dist.barrier()
    if dist.get_rank() != 0:
        paths = prepare_default_data(data_dir)  # outputs exist: returns their paths at once
    tp = 2 if world_size >= 2 else 1
    pp = 2 if world_size >= 4 else 1
    dp = world_size // (tp * pp)
    micro = 4
    layers, hidden, heads, seq = (8, 512, 8, 512) if on_gpu else (4, 128, 4, 128)
    argv = f"""
        --num-layers {layers} --hidden-size {hidden} --num-attention-heads {heads}
        --seq-length {seq} --max-position-embeddings 512
        --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}
        --micro-batch-size {micro} --global-batch-size {micro * dp * 4}
        --train-iters {300 if on_gpu else 200}
        --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10
        --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0
        --split 98,2,0 --log-interval 10 --eval-interval 100 --eval-iters 2
        --num-workers 0 --seed 1234 --save-interval 100
    """.split()
    argv += [
        "--data-path", paths["data_prefix"],
        "--tokenizer-type", paths["tokenizer_type"],
        "--tokenizer-model", paths["tokenizer_model"],
        "--save", os.path.join(run_dir, "checkpoints"),
    ]  # fmt: skip
    if on_gpu:
        argv += ["--bf16", "--use-distributed-optimizer"]
    return argv + extra
