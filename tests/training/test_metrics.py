"""FLOPs formula, the Megatron log line, an offline W&B run read back from its files, and the
console of a tiny torchrun job."""

import json
import os
import re
import subprocess
import sys
from datetime import datetime
from fractions import Fraction
from pathlib import Path

import pytest

from megadyn.models.config import GPTConfig
from megadyn.testing import free_port
from megadyn.training.config import LoggingConfig, MegadynConfig
from megadyn.training.metrics import (
    IterationStats,
    format_iteration_line,
    mfu,
    model_flops_per_iteration,
    wandb_metrics,
)
from megadyn.training.wandb_logger import (
    NullWandbLogger,
    WandbLogger,
    create_wandb_logger,
    read_offline_config,
    read_offline_history,
)
from tests.tiny import tiny_args

REPO = Path(__file__).resolve().parents[2]


def paper_flops(B: int, s: int, l: int, h: int, V: int) -> Fraction:  # noqa: E741
    """Narayanan et al. 2021: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)), exactly."""
    return 72 * B * s * l * h**2 * (1 + Fraction(s, 6 * h) + Fraction(V, 12 * l * h))


@pytest.mark.parametrize(
    "layers, hidden, heads, vocab, batch, seq, tp",
    [
        (24, 2048, 16, 50257, 16, 2048, 1),  # the 1.42B reference shape of shared/bench
        (24, 2048, 16, 50257, 16, 2048, 2),
        (2, 64, 4, 100, 3, 32, 1),
        (12, 768, 12, 50257, 8, 1024, 4),
    ],
)
def test_flops_equal_the_paper_formula_for_the_gpt2_block(
    layers, hidden, heads, vocab, batch, seq, tp
):
    cfg = GPTConfig.gpt2(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=vocab,
        max_position_embeddings=seq,
    )  # fmt: skip
    padded = cfg.padded_vocab_size(tp)
    assert model_flops_per_iteration(cfg, batch, seq, tp=tp) == paper_flops(
        batch, seq, layers, hidden, padded
    )


def test_flops_for_gqa_and_swiglu_count_each_matmul():
    h, n, g, f, s, B, V, l = 256, 8, 2, 688, 128, 4, 1000, 3  # noqa: E741
    cfg = GPTConfig.llama(
        num_layers=l, hidden_size=h, num_attention_heads=n, num_query_groups=g,
        ffn_hidden_size=f, vocab_size=V, make_vocab_size_divisible_by=8,
    )  # fmt: skip
    d = h // n
    weights = h * n * d + 2 * h * g * d + h * h + 3 * h * f  # q, k+v, out, gate+up+down
    attention = 2 * s * n * d  # QK^T and PV, per token, full square
    per_token = l * (weights + attention) + h * cfg.padded_vocab_size(1)
    assert model_flops_per_iteration(cfg, B, s) == 6 * B * s * per_token
    assert mfu(494.5) == pytest.approx(0.5)


MEGATRON_LINE = re.compile(
    r"^ \[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\]"
    r" iteration +\d+/ +\d+ \|"
    r" consumed samples: +\d+ \|"
    r" elapsed time per iteration \(ms\): \d+\.\d \|"
    r" throughput per GPU \(TFLOP/s/GPU\): \d+\.\d \|"
    r" learning rate: \d\.\d{6}E[+-]\d{2} \|"
    r" global batch size: +\d+ \|"
    r" lm loss: \d\.\d{6}E[+-]\d{2} \|"
    r" loss scale: \d+\.\d \|"
    r" grad norm: \d+\.\d{3} \|"
    r" number of skipped iterations: +\d+ \|"
    r" number of nan iterations: +\d+ \|"
    r" tokens/s: \d+ \| MFU: \d+\.\d% \| peak mem \(GiB\): \d+\.\d{2} \|$"
)


STATS = IterationStats(
    iteration=10, train_iters=500, consumed_samples=160, elapsed_ms=1234.56,
    learning_rate=1e-4, global_batch_size=16, losses={"lm loss": 1.234567}, loss_scale=1.0,
    grad_norm=1.2345, tflops_per_gpu=412.34, tokens_per_sec=26543.2, mfu=0.4169,
    peak_mem_gib=31.04,
)  # fmt: skip


def test_iteration_line_has_megatrons_format():
    stats = STATS
    line = format_iteration_line(stats, now=datetime(2026, 11, 26, 1, 2, 3), log_throughput=True)
    assert MEGATRON_LINE.match(line), line
    assert line.startswith(
        " [2026-11-26 01:02:03] iteration       10/     500 | consumed samples:          160 |"
        " elapsed time per iteration (ms): 1234.6 | throughput per GPU (TFLOP/s/GPU): 412.3 |"
        " learning rate: 1.000000E-04 | global batch size:    16 | lm loss: 1.234567E+00 |"
        " loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |"
        " number of nan iterations:   0 |"
    )
    assert line.endswith(" tokens/s: 26543 | MFU: 41.7% | peak mem (GiB): 31.04 |")
    metrics = wandb_metrics(stats)
    assert metrics["lm loss"] == 1.234567 and metrics["iteration-time"] == pytest.approx(1.23456)


def test_tflops_field_only_with_log_throughput():
    """As Megatron's, the TFLOP/s field needs --log-throughput; tokens/s and MFU are always
    there."""
    now = datetime(2026, 11, 26, 1, 2, 3)
    with_it = format_iteration_line(STATS, now=now, log_throughput=True)
    without = format_iteration_line(STATS, now=now)
    assert without == with_it.replace(" throughput per GPU (TFLOP/s/GPU): 412.3 |", "")
    assert "TFLOP/s" not in without and " tokens/s: 26543 | MFU: 41.7% |" in without


def test_wandb_offline_run_holds_the_logged_losses(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cfg = MegadynConfig(logging=LoggingConfig(wandb_project="megadyn-test", wandb_exp_name="t"))
    assert isinstance(create_wandb_logger(cfg, rank=0, world_size=2), NullWandbLogger)
    assert not create_wandb_logger(MegadynConfig(), rank=1, world_size=2).enabled
    cfg = MegadynConfig(
        logging=LoggingConfig(wandb_project="megadyn-test", wandb_save_dir=str(tmp_path))
    )
    logger = create_wandb_logger(cfg, rank=1, world_size=2)
    assert isinstance(logger, WandbLogger)
    run = logger.run_dir
    assert capsys.readouterr().out == (
        f" W&B: offline run, project megadyn-test, run dir {run} (upload with: wandb sync {run})\n"
    )
    losses = [3.5, 2.75, 2.125]
    for step, loss in enumerate(losses, start=1):
        logger.log({"lm loss": loss, "learning-rate": 1e-4 * step}, step=step)
    logger.log_event("reshard", {"seconds": 1.5})
    logger.finish()
    assert logger.run_dir.parent == tmp_path / "wandb" and logger.run_dir.name.startswith(
        "offline-"
    )
    rows = read_offline_history(logger.run_dir)
    assert [(r["_step"], r["lm loss"]) for r in rows] == list(enumerate(losses, start=1))
    assert rows[-1]["event/reshard/seconds"] == 1.5
    assert read_offline_config(logger.run_dir)["logging.wandb_project"] == "megadyn-test"


TINY = tiny_args(
    tokenizer_type="GPT2BPETokenizer",
    vocab_size=None,
    make_vocab_size_divisible_by=8,
    train_iters=4,
    eval_interval=0,
    log_interval=1,
    tensor_model_parallel_size=2,
    sequence_parallel=True,
    save_interval=2,
)


def gpt2_bpe_files(directory: Path) -> list[str]:
    """--vocab-file / --merge-file of a GPT-2 BPE of the 256 byte symbols, 2 merges and
    <|endoftext|>: 259 tokens."""
    from megadyn.data.gpt2_bpe import bytes_to_unicode

    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    vocab.update({"he": 256, "Ġthe": 257, "<|endoftext|>": 258})
    (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\nh e\nĠt he\n", encoding="utf-8")
    return [
        "--vocab-file",
        str(directory / "vocab.json"),
        "--merge-file",
        str(directory / "merges.txt"),
    ]


def test_console_of_a_tiny_torchrun_job(tmp_path):
    """2 processes at tp 2 with sequence parallelism (its gathers and scatters), saving twice,
    W&B offline, --log-throughput: no deprecation warning from any rank, at start or after a
    save; one W&B line; the run config holds the tokenizer's vocabulary (259, not the default
    of --vocab-size); the iteration lines carry TFLOP/s."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="offline")
    env.pop("WANDB_API_KEY", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port()), "pretrain_gpt.py", *TINY]
    cmd += gpt2_bpe_files(tmp_path)
    cmd += ["--save", str(tmp_path / "ckpt"), "--wandb-project", "tiny", "--log-throughput"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    warnings = [
        line
        for line in done.stderr.splitlines()
        if re.search(r"FutureWarning|DeprecationWarning|is deprecated", line)
    ]
    assert not warnings, "\n".join(warnings)
    said = [line for line in done.stdout.splitlines() if line.startswith(" W&B: ")]
    assert len(said) == 1 and said[0].startswith(" W&B: offline run, project tiny, run dir "), said
    (run,) = (tmp_path / "ckpt" / "wandb").rglob("offline-run-*")
    assert str(run) in said[0]
    assert read_offline_config(run)["model.vocab_size"] == 259
    lines = [line for line in done.stdout.splitlines() if "| consumed samples:" in line]
    assert len(lines) == 4 and all("| throughput per GPU (TFLOP/s/GPU): " in x for x in lines)
