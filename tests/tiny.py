"""The pretrain_gpt.py flags of the tiny jobs that megadyn's tests parse and run, in one place.

    from tests.tiny import RUN, TRAINING, tiny_args

    tiny_args(train_iters=4)                         # TINY: 2 layers, hidden 32, mock data
    tiny_args(RUN, num_layers=4, train_iters=6)      # a run: log every step, no evaluation
    tiny_args(TRAINING, use_distributed_optimizer=True)
    tiny_args(mock_data=None, data_path=prefix)      # None leaves one of TINY's flags out

A keyword names a flag with `_` for `-` (`global_batch_size=8` is `--global-batch-size 8`),
True passes a switch, None or False leaves the flag out. Values are written with str(), so pass
a learning rate as written (`lr="1e-2"`, not 0.01). TINY comes first, then the presets (dicts
of the same keywords) in order, then the keywords; a later value replaces an earlier one where
it stands. A test module names its own job as a preset (test_live_reconfiguration.LIVE) and
asks for variants of it: `tiny_args(LIVE, train_iters=200)`. A flag whose name holds `_`
(`--override-opt_param-scheduler`) goes after the list.
"""

from __future__ import annotations

TINY = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "seq_length": 16,
    "max_position_embeddings": 16,
    "mock_data": True,
    "tokenizer_type": "NullTokenizer",
    "vocab_size": 60,
    "micro_batch_size": 1,
    "global_batch_size": 4,
    "lr": "1e-3",
}
"""A 2-layer GPT of hidden size 32 on mock data (NullTokenizer, 60 tokens and its EOD),
sequences of 16 tokens, 1 sample a micro batch, 4 a step. No --train-iters: each test says how
long it trains."""

RUN = {"log_interval": 1, "eval_interval": 0, "num_workers": 0}
"""A run: an iteration line every step, no evaluation, data read in the training process."""

REPEATABLE = {"hidden_dropout": 0, "attention_dropout": 0, "seed": 7}
"""Runs whose losses can be compared: no dropout, one seed."""

EIGHT_WAY = {
    "hidden_size": 64,
    "num_attention_heads": 8,
    "seq_length": 32,
    "max_position_embeddings": None,  # = --seq-length
    "micro_batch_size": 2,
    "global_batch_size": 16,
    "vocab_size": 100,
}
"""A model and batch that divide among 8 processes (8 heads of hidden size 64, 16 samples a
step in micro batches of 2), for the tests that parse flags at world size 8."""

TRAINING = {
    **RUN,
    **REPEATABLE,
    "make_vocab_size_divisible_by": 8,
    "lr": "1e-2",
    "min_lr": "1e-3",
    "lr_decay_style": "cosine",
    "lr_warmup_iters": 2,
    "weight_decay": 0.1,
    "clip_grad": 1.0,
}
"""The end-to-end training tests' job (layouts, resumes, live changes, conversion compare its
losses): a repeatable run with warm-up, cosine decay, weight decay and clipping."""


def tiny_args(*presets: dict, **flags: object) -> list[str]:
    """The flags of TINY updated by each preset in turn, then by `flags` (see the module)."""
    merged = dict(TINY)
    for preset in (*presets, flags):
        merged.update(preset)
    argv = []
    for name, value in merged.items():
        if value is None or value is False:
            continue
        argv.append("--" + name.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return argv
