"""--dynamic-parallelism (hot switching): on 4 processes a skewed mix of documents (many short,
some long) trains in two length groups per step, the short ones data-parallel over 4 ranks (the
base layout) and the long ones under tensor parallelism 4, switching twice per step; the losses
equal a static dp 4 run's on the same samples within 1e-5 and every sample is drawn once. A
tp 2 x dp 2 base with memory for everything runs every sample at dp 4 (weights gathered over
tp, gradients sliced back), with the same losses. The switch's moves equal the reshard
executor's bit for bit. The planner is checked without processes."""

import numpy as np
import pytest

from megadyn.core.layout import Layout
from megadyn.core.recompute import RecomputeConfig
from megadyn.data.token_budget import split_by_weight
from megadyn.elastic.planning.layouts import memory_gib
from megadyn.elastic.planning.lengths import plan_length_groups
from megadyn.models.config import GPTConfig
from megadyn.testing import spawn
from megadyn.testing.corpus import write_corpus
from megadyn.training.arguments import parse_args
from megadyn.training.config import ConfigError
from tests.tiny import REPEATABLE, RUN, tiny_args

MODEL = GPTConfig(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=4,
    vocab_size=61,  # NullTokenizer's 60 and its EOD
    max_position_embeddings=64,
    make_vocab_size_divisible_by=8,
)
STEPS, GBS, SHORT_BUDGET = 2, 16, 36
# the memory that holds a micro batch of 36 tokens at dp 4 beside a tp 4 copy of the model, so
# longer samples need tp
MEMORY_GIB = memory_gib(MODEL, Layout(dp=4), 1, SHORT_BUDGET, RecomputeConfig()) + memory_gib(
    MODEL, Layout(tp=4), 1, 0, RecomputeConfig(), optimizer=False
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """120 documents: three in four of 3..24 tokens, the rest of 45..100 (cut at 64)."""
    rng = np.random.default_rng(3)
    texts = []
    for i in range(120):
        n = int(rng.integers(45, 100)) if i % 4 == 0 else int(rng.integers(3, 24))
        texts.append(" ".join(str(int(t)) for t in rng.integers(0, 60, n)))
    return write_corpus(tmp_path_factory.mktemp("hot"), texts, vocab_size=60)


JOB = {
    **RUN,
    **REPEATABLE,
    "hidden_size": 16,
    "seq_length": 64,
    "max_position_embeddings": 64,
    "make_vocab_size_divisible_by": 8,
    "mock_data": None,
    "split": "100,0,0",
    "sample_per_document": True,
    "micro_batch_tokens": 64,
    "micro_batch_size": None,
    "global_batch_size": GBS,
    "lr": "1e-2",
    "clip_grad": 1.0,
    "seed": 5,
    "train_iters": STEPS,
    "use_distributed_optimizer": True,
}
"""MODEL's job on the corpus: one document a sample, 64 tokens a micro batch, GBS samples a
step for STEPS steps."""


def flags(prefix: str, **overrides) -> list[str]:
    return tiny_args(JOB, data_path=prefix, **overrides)


def static_and_hot(rank, world, argv):
    """A static dp 4 run, then a hot-switched one over the same processes: losses, the
    hot run's plan, step records and drawn samples."""
    from megadyn.core.groups import ParallelGroups
    from megadyn.training.trainer import Trainer

    out = {}
    hot = ["--dynamic-parallelism", "--dynamic-parallelism-memory-gib", repr(MEMORY_GIB)]
    # base tp 2 x dp 2 with room for all: every sample runs at dp 4 (weights gathered over tp)
    tp_base = ["--dynamic-parallelism", "--tensor-model-parallel-size", "2"]
    for name, extra in (("static", []), ("hot", hot), ("tp_base", tp_base)):
        cfg = parse_args(argv + extra, world_size=world)
        groups = ParallelGroups.build(cfg.layout(world), range(world))
        trainer = Trainer(cfg, groups, "cpu", print_fn=lambda *a, **k: None)
        out[name] = [trainer.train_step().loss.item() for _ in range(STEPS)]
        if name == "tp_base":
            out["tp_base_plan"] = [g.layout for g in trainer.hot.plan.groups]
            out["tp_base_switches"] = [r.switches for r in trainer.hot.records]
        elif trainer.hot is not None:
            out["plan"] = [(g.layout, g.max_tokens, g.lengths) for g in trainer.hot.plan.groups]
            out["records"] = trainer.hot.records
            out["drawn"] = trainer.samples_drawn
        trainer.release()
        groups.destroy()
    # the all-gather moves against the reshard executor's (dp 4 <-> tp 4): bit-equal
    from megadyn.bench.hot_switch import model_config, run

    cfg = model_config(2, 16, 4, 32, 61, bf16=False).with_(make_vocab_size_divisible_by=8)
    rows = run(cfg, "cpu", repeats=1)
    out["moves_bit_equal"] = [r["bit_equal"] for r in rows]
    return out


def test_hot_switching_equals_a_static_layout(corpus):
    results = spawn(static_and_hot, world=4, args=(flags(corpus),), timeout_s=600)
    plan = results[0]["plan"]
    assert [(lay, budget) for lay, budget, _ in plan] == [
        (Layout(dp=4), SHORT_BUDGET),
        (Layout(tp=4), 64),
    ], plan
    for r in results:
        np.testing.assert_allclose(r["hot"], results[0]["static"], rtol=1e-5, atol=1e-6)
        for record in r["records"]:  # short and long samples in every step: two switches
            assert [g.layout for g in record.groups] == [Layout(dp=4), Layout(tp=4)], record
            assert record.switches == 2 and record.groups[1].shortest > SHORT_BUDGET, record
            assert sum(g.samples for g in record.groups) == GBS
            assert all(g.seconds > 0 for g in record.groups), record  # each group timed
            assert " ms; " in record.describe().split("tp4xdp1 in ")[1], record.describe()
        np.testing.assert_allclose(r["tp_base"], results[0]["static"], rtol=1e-5, atol=1e-6)
        assert r["tp_base_plan"] == [Layout(dp=4)] and r["tp_base_switches"] == [2] * STEPS
    assert results[0]["moves_bit_equal"] == [True, True]
    drawn = sorted(i for r in results for i in r["drawn"])
    assert drawn == list(range(STEPS * GBS)), drawn  # each once, by one rank


def test_the_plan_follows_memory_and_cost():
    base = Layout(dp=4)
    plan = plan_length_groups(
        MODEL, base, budget=64, seq_length=64, global_batch_size=GBS, gpu_memory_gib=1e9
    )
    assert [g.layout for g in plan.groups] == [base]  # room for all: no switching
    plan = plan_length_groups(
        MODEL, base, budget=64, seq_length=64, global_batch_size=GBS, gpu_memory_gib=MEMORY_GIB
    )
    assert [g.lengths for g in plan.groups] == [((1, 36),), ((37, 64),)]
    assert plan.assign([5, 40, 36, 64]) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="--dynamic-parallelism-memory-gib"):
        plan_length_groups(
            MODEL, base, budget=64, seq_length=64, global_batch_size=GBS, gpu_memory_gib=1e-6
        )


def test_split_by_weight_deals_heaviest_first():
    assert split_by_weight([1, 9, 4, 4, 1], 2) == [[1, 4], [0, 2, 3]]
    assert split_by_weight([3], 2) == [[0], []]


def test_what_cannot_run_is_refused_by_name():
    argv = flags("d") + ["--dynamic-parallelism"]
    no_docs = flags("d", sample_per_document=None, micro_batch_tokens=None, micro_batch_size=1)
    no_docs += ["--dynamic-parallelism"]
    with pytest.raises(ConfigError, match="--dynamic-parallelism groups samples by length"):
        parse_args(no_docs, world_size=1)
    with pytest.raises(ConfigError, match="--dynamic-parallelism does not run with --overlap-p"):
        parse_args(argv + ["--overlap-param-gather", "--overlap-grad-reduce"], world_size=2)
