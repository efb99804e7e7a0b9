"""The command line: frozen flag list, Megatron-style commands, and errors that name their flag."""

import dataclasses
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from megadyn.core.layout import Layout
from megadyn.training import config as config_module
from megadyn.training.arguments import ConfigError, build_parser, dump_args, parse_args
from megadyn.training.config import field_docs
from tests.tiny import EIGHT_WAY, tiny_args

REPO = Path(__file__).resolve().parents[2]

FLAGS = [
    "--adam-beta1", "--adam-beta2", "--adam-eps", "--async-save", "--attention-backend",
    "--attention-dropout", "--context-parallel-size", "--cp-block-size", "--cp-comm-type",
    "--cp-placement",
    "--cross-entropy-loss-fusion", "--cuda-graph-warmup-steps",
    "--enable-cuda-graph", "--no-cross-entropy-loss-fusion",
    "--no-gradient-accumulation-fusion", "--pointwise-fusion", "--no-norm-fusion",
    "--no-bias-swiglu-fusion", "--no-rope-fusion", "--keep-fc2-input", "--keep-norm-outputs", "--cross-entropy-chunks", "--no-fp8-weight-cache", "--no-bias-dropout-fusion",
    "--bf16", "--ckpt-keep-last", "--ckpt-step", "--clip-grad", "--data-cache-path", "--data-parallel-sharding-strategy", "--data-path", "--deterministic-mode",
    "--disable-bias-linear", "--distributed-timeout-minutes", "--elastic-control-interval", "--elastic-control-port", "--elastic-initial-members",
    "--no-elastic-fork-server", "--elastic-heartbeat-timeout", "--elastic-layout", "--elastic-recovery", "--exit-signal-handler", "--elastic-min-members", "--elastic-reshard-chunk-mb",
    "--elastic-snapshot-dir", "--elastic-snapshot-interval", "--elastic-straggler-policy", "--end-weight-decay", "--eval-interval", "--eval-iters",
    "--exit-interval", "--ffn-hidden-size", "--finetune", "--fp16", "--fp8-format", "--fp8-recipe", "--global-batch-size",
    "--group-query-attention", "--help", "--heterogeneous-pipelines", "--hidden-dropout", "--hidden-size", "--hysteresis",
    "--init-method-std", "--initial-loss-scale", "--load", "--log-interval", "--log-num-zeros-in-grad", "--log-straggler", "--log-throughput",
    "--loss-scale", "--loss-scale-window", "--lr", "--lr-decay-iters", "--lr-decay-style", "--lr-warmup-fraction",
    "--lr-warmup-init", "--lr-warmup-iters", "--lr-wsd-decay-iters", "--lr-wsd-decay-style",
    "--make-vocab-size-divisible-by", "--max-position-embeddings", "--merge-file", "--metrics-file",
    "--micro-batch-size", "--micro-batch-tokens", "--dynamic-parallelism",
    "--dynamic-parallelism-memory-gib", "--min-loss-scale", "--min-lr", "--mock-data", "--no-load-optim",
    "--no-load-rng", "--no-scatter-gather-tensors-in-pipeline", "--norm-epsilon",
    "--normalization", "--num-attention-heads", "--num-layers",
    "--num-layers-per-virtual-pipeline-stage", "--num-query-groups", "--num-workers", "--openai-gelu",
    "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler",
    "--num-distributed-optimizer-instances", "--overlap-grad-reduce", "--overlap-param-gather",
    "--pipeline-model-parallel-size",
    "--position-embedding-type", "--rampup-batch-size", "--recompute-granularity",
    "--recompute-method", "--recompute-num-layers", "--rotary-base", "--save", "--save-interval",
    "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--sample-per-document",
    "--seed", "--seq-length", "--sequence-parallel", "--split", "--start-weight-decay", "--straggler-intervals",
    "--straggler-threshold",
    "--swiglu", "--tensor-model-parallel-size", "--tp-comm-overlap", "--tp-comm-overlap-transport", "--timing-log-level", "--tokenizer-model",
    "--tokenizer-type", "--train-iters", "--train-samples", "--untie-embeddings-and-output-weights",
    "--use-distributed-optimizer", "--use-precision-aware-optimizer", "--vocab-file", "--vocab-size", "--wandb-exp-name",
    "--wandb-project", "--wandb-save-dir", "--weight-decay", "--weight-decay-incr-style", "-h",
]  # fmt: skip

BASE = shlex.join(tiny_args(EIGHT_WAY, num_layers=8, train_iters=100))


NO_DROPOUT = "--hidden-dropout 0 --attention-dropout 0"


def parse(extra: str = "", world_size: int = 8, base: str = BASE):
    return parse_args(shlex.split(f"{base} {extra}"), world_size=world_size)


def test_flag_list_is_frozen():
    parser = build_parser()
    flags = sorted(s for action in parser._actions for s in action.option_strings)
    assert flags == sorted(FLAGS)


def test_every_config_field_has_a_docstring():
    for cls in (
        config_module.ParallelConfig,
        config_module.TrainingConfig,
        config_module.SchedulerConfig,
        config_module.DataConfig,
        config_module.CheckpointConfig,
        config_module.LoggingConfig,
        config_module.MegadynConfig,
    ):
        names = {f.name for f in dataclasses.fields(cls)}
        assert names == set(field_docs(cls)), cls.__name__


def test_megatron_style_command():
    cmd = (
        "--num-layers 24 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 "
        "--seq-length 2048 --max-position-embeddings 2048 --untie-embeddings-and-output-weights "
        "--hidden-dropout 0 --attention-dropout 0 --micro-batch-size 2 --global-batch-size 32 "
        "--train-iters 500 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine "
        "--lr-warmup-fraction 0.01 --weight-decay 0.1 --clip-grad 1.0 --bf16 "
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
        "--num-layers-per-virtual-pipeline-stage 6 --sequence-parallel "
        "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
        "--data-path 0.3 corpus_a 0.7 corpus_b --split 949,50,1 --tokenizer-type GPT2BPETokenizer "
        "--vocab-file v.json --merge-file m.txt --save ck --load ck --save-interval 100 "
        "--log-interval 10 --log-throughput --timing-log-level 2 --wandb-project p "
        "--wandb-exp-name e --ckpt-keep-last 2"
    )
    cfg = parse_args(shlex.split(cmd), world_size=16)
    assert cfg.layout(16) == Layout(tp=2, pp=2, dp=4, vpp=2, sequence_parallel=True)
    assert cfg.model.params_dtype == torch.bfloat16
    assert cfg.model.vocab_size == 50257 and cfg.model.padded_vocab_size(2) == 50432
    assert cfg.model.hidden_dropout == 0.0 and cfg.model.untie_embeddings_and_output_weights
    assert cfg.data.data_path == ("0.3", "corpus_a", "0.7", "corpus_b")
    assert cfg.optimizer.lr == 3e-4 and cfg.optimizer.use_distributed_optimizer
    assert cfg.training.recompute.method == "uniform"
    assert cfg.checkpoint.keep_last == 2 and cfg.logging.wandb_project == "p"
    flat = dump_args(cfg)
    assert flat["parallel.tp"] == 2 and flat["model.params_dtype"] == "bfloat16"
    json.dumps(flat)  # plain values only


@pytest.mark.parametrize(
    "extra, fields",
    [
        ("", dict(attention_backend="auto", gradient_accumulation_fusion=True, fused_loss=None)),
        (
            "--attention-backend fused --no-gradient-accumulation-fusion "
            "--no-cross-entropy-loss-fusion",
            dict(
                attention_backend="fused",
                gradient_accumulation_fusion=False,
                fused_loss=False,
            ),
        ),
        ("--cross-entropy-loss-fusion", dict(fused_loss=True)),
        ("", dict(pointwise_fusion=False, norm_fusion=True, apply_rope_fusion=True)),
        ("", dict(keep_fc2_input=False)),
        ("--pointwise-fusion --keep-fc2-input", dict(pointwise_fusion=True, keep_fc2_input=True)),
        ("--keep-norm-outputs", dict(keep_norm_outputs=True)),
        ("", dict(cross_entropy_chunks=1, fp8_weight_cache=True)),
        (
            "--cross-entropy-chunks 4 --no-fp8-weight-cache",
            dict(cross_entropy_chunks=4, fp8_weight_cache=False),
        ),
        (
            "--pointwise-fusion --no-norm-fusion --no-bias-swiglu-fusion --no-rope-fusion "
            "--no-bias-dropout-fusion",
            dict(
                pointwise_fusion=True,
                norm_fusion=False,
                bias_swiglu_fusion=False,
                apply_rope_fusion=False,
                bias_dropout_fusion=False,
            ),
        ),
    ],
)
def test_kernel_switches_reach_the_model(extra, fields):
    model = parse(extra, world_size=1).model
    assert {k: getattr(model, k) for k in fields} == fields


def test_megatron_defaults_and_derived_values():
    cfg = parse(world_size=8)
    assert cfg.model.hidden_dropout == 0.1 and cfg.model.attention_dropout == 0.1
    assert cfg.model.max_position_embeddings == 32  # = --seq-length when not given
    assert cfg.model.vocab_size == 101  # NullTokenizer appends an end-of-document token
    assert cfg.model.num_query_groups is None  # --num-query-groups counts only with GQA
    assert cfg.optimizer.initial_loss_scale == 2.0**32 and cfg.training.seed == 1234
    llama = parse("--swiglu --group-query-attention --num-query-groups 2 --disable-bias-linear")
    assert llama.model.activation == "swiglu" and llama.model.num_query_groups == 2
    assert llama.model.ffn_hidden_size == 128 and not llama.model.add_bias_linear  # 8*64/3 -> 128
    no_gbs = parse_args(shlex.split(BASE.replace("--global-batch-size 16", "")), world_size=4)
    assert no_gbs.training.global_batch_size == 2 * 4
    samples = parse("--train-samples 1600", base=BASE.replace("--train-iters 100", ""))
    assert samples.training.train_iters == 100


@pytest.mark.parametrize(
    "extra, world_size, flag",
    [
        ("--tensor-model-parallel-size 4", 6, "--tensor-model-parallel-size"),
        ("--global-batch-size 24", 8, "--global-batch-size"),
        ("--tokenizer-type Nope", 8, "--tokenizer-type"),
        ("--bf16 --fp16", 8, "--bf16"),
        ("--recompute-method uniform", 8, "--recompute-method"),
        ("--recompute-granularity full", 8, "--recompute-granularity"),
        ("--recompute-granularity selective --recompute-num-layers 1", 8, "--recompute-num-layers"),
        ("--recompute-granularity full --recompute-method block --recompute-num-layers 9", 8,
         "--recompute-num-layers"),
        ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3", 8,
         "--num-layers-per-virtual-pipeline-stage"),
        ("--num-layers-per-virtual-pipeline-stage 2", 8, "--num-layers-per-virtual-pipeline-stage"),
        ("--micro-batch-size 1 --global-batch-size 3 --pipeline-model-parallel-size 2 "
         "--num-layers-per-virtual-pipeline-stage 2", 2, "--num-layers-per-virtual-pipeline-stage"),
        ("--pipeline-model-parallel-size 3", 6, "--num-layers"),
        ("--sequence-parallel", 8, "--sequence-parallel"),
        ("--tensor-model-parallel-size 16", 16, "--num-attention-heads"),
        ("--hidden-size 60", 8, "--hidden-size"),
        ("--overlap-param-gather", 8, "--overlap-param-gather"),
        ("--train-samples 100", 8, "--train-iters"),
        ("--rampup-batch-size 4 4 100", 8, "--rampup-batch-size"),
        ("--lr-warmup-iters 100", 8, "--lr-warmup-iters"),
        ("--lr-warmup-iters 10 --lr-warmup-fraction 0.1", 8, "--lr-warmup-fraction"),
        ("--min-lr 1", 8, "--min-lr"),
        ("--lr-decay-style WSD", 8, "--lr-wsd-decay-iters"),
        ("--start-weight-decay 0.1", 8, "--start-weight-decay"),
        ("--weight-decay-incr-style linear", 8, "--weight-decay-incr-style"),
        ("--max-position-embeddings 16", 8, "--max-position-embeddings"),
        ("--data-path corpus", 8, "--data-path"),
        ("--save ckpts", 8, "--save-interval"),
        ("--ckpt-keep-last 0", 8, "--ckpt-keep-last"),
        ("--elastic-initial-members 16", 8, "--elastic-initial-members"),
        ("--elastic-min-members 9", 8, "--elastic-min-members"),
        ("--distributed-timeout-minutes 0", 8, "--distributed-timeout-minutes"),
        ("--elastic-heartbeat-timeout -1", 8, "--elastic-heartbeat-timeout"),
        ("--tp-comm-overlap --tensor-model-parallel-size 2", 8, "--tp-comm-overlap"),
        ("--tp-comm-overlap-transport copy-engine --tensor-model-parallel-size 2 "
         "--sequence-parallel", 8, "--tp-comm-overlap-transport"),
        ("--tp-comm-overlap-transport shm", 8, "--tp-comm-overlap-transport"),
        ("--enable-cuda-graph", 8, "--enable-cuda-graph"),  # Megatron's default dropout 0.1
        (f"--enable-cuda-graph {NO_DROPOUT} --pipeline-model-parallel-size 2", 8,
         "--enable-cuda-graph"),
        (f"--enable-cuda-graph {NO_DROPOUT} --recompute-granularity selective", 8,
         "--enable-cuda-graph"),
        (f"--enable-cuda-graph {NO_DROPOUT} --cuda-graph-warmup-steps 0", 8,
         "--cuda-graph-warmup-steps"),
        ("--micro-batch-size two", 8, "--micro-batch-size"),
        ("--no-such-flag 3", 8, "--no-such-flag"),
    ],
)  # fmt: skip
def test_validation_errors_name_their_flag(extra, world_size, flag):
    with pytest.raises(ConfigError) as err:
        parse(extra, world_size)
    assert str(err.value).startswith(flag), str(err.value)


@pytest.mark.parametrize(
    "drop, add, flag",
    [
        ("--mock-data", "", "--data-path"),
        ("--vocab-size 100", "", "--vocab-size"),
        ("--num-layers 8", "", "--num-layers"),
        ("--lr 1e-3", "", "--lr"),
        ("--tokenizer-type NullTokenizer", "", "--tokenizer-type"),
        ("--mock-data", "--data-path 0.5 a -1 b", "--data-path"),
        ("--mock-data", "--data-path a --split 0,0,0", "--split"),
        ("--tokenizer-type NullTokenizer", "--tokenizer-type GPT2BPETokenizer", "--vocab-file"),
        ("--tokenizer-type NullTokenizer", "--tokenizer-type HuggingFaceTokenizer",
         "--tokenizer-model"),
        ("--train-iters 100", "--train-samples 1000 --rampup-batch-size 4 5 100",
         "--rampup-batch-size"),
        ("--train-iters 100", "--train-samples 1000 --rampup-batch-size 4 4 100",
         "--rampup-batch-size"),  # 4 is not divisible by micro batch 2 x dp 8
    ],
)  # fmt: skip
def test_missing_or_inconsistent_flags(drop, add, flag):
    with pytest.raises(ConfigError) as err:
        parse(add, base=BASE.replace(drop, ""))
    assert str(err.value).startswith(flag), str(err.value)


def _script_argv(script: str, env: dict[str, str]) -> list[str]:
    """The pretrain_gpt.py arguments an example script passes to torchrun (torchrun stubbed)."""
    stub = 'torchrun() { printf "%s\\n" "$@"; }; export -f torchrun; bash "$0"'
    out = subprocess.run(
        ["bash", "-c", stub, str(REPO / "examples" / script)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return out[out.index("pretrain_gpt.py") + 1 :]


@pytest.mark.parametrize(
    "script, env, world_size",
    [
        ("train_gpt_single_node.sh", {}, 8),
        ("train_gpt_single_node.sh", {"TP": "2", "GPUS_PER_NODE": "4"}, 4),
        ("train_gpt_multi_node.sh", {"MASTER_ADDR": "node0", "ELASTIC_INITIAL_MEMBERS": "8"}, 16),
    ],
)
def test_example_scripts_parse(script, env, world_size):
    cfg = parse_args(_script_argv(script, env), world_size=world_size)
    assert cfg.model.num_layers == 24 and cfg.model.padded_vocab_size(1) == 50304
    assert cfg.model.params_dtype == torch.bfloat16


def test_cuda_graph_flags():
    cfg = parse(f"--enable-cuda-graph {NO_DROPOUT} --tensor-model-parallel-size 2", 8)
    assert cfg.training.enable_cuda_graph and cfg.training.cuda_graph_warmup_steps == 3
    assert not parse().training.enable_cuda_graph
    assert (
        parse(
            f"--enable-cuda-graph {NO_DROPOUT} --cuda-graph-warmup-steps 1"
        ).training.cuda_graph_warmup_steps
        == 1
    )


def test_cuda_graph_needs_cuda_and_a_replanned_pipeline_turns_it_off():
    from megadyn.core.layout import Layout
    from megadyn.launch.replan import config_for_world, with_layout

    argv = shlex.split(f"{BASE} --enable-cuda-graph {NO_DROPOUT}")
    with pytest.raises(ConfigError, match="^--enable-cuda-graph needs CUDA devices"):
        config_for_world(argv, 8, restarted=False, device_type="cpu")
    cfg = config_for_world(argv, 8, restarted=False, device_type="cuda")
    assert with_layout(cfg, Layout(tp=2, dp=4)).training.enable_cuda_graph
    assert not with_layout(cfg, Layout(tp=2, pp=2, dp=2)).training.enable_cuda_graph


def test_the_copy_engine_transport_needs_cuda():
    from megadyn.launch.replan import config_for_world

    flags = "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap"
    argv = shlex.split(f"{BASE} {flags} --tp-comm-overlap-transport copy-engine")
    with pytest.raises(ConfigError, match="^--tp-comm-overlap-transport copy-engine needs CUDA"):
        config_for_world(argv, 8, restarted=False, device_type="cpu")
    cfg = config_for_world(argv, 8, restarted=False, device_type="cuda")
    assert cfg.model.comm_overlap == "copy-engine"
