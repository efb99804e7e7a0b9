"""A model trained by pretrain_gpt.py, exported, continues a prompt in transformers exactly as
tools/generate.py does; an imported HF model fine-tunes directly with pretrain_gpt.py --load."""

import json
import os
import subprocess
import sys

import torch
from convert_helpers import REPO, TRAIN, export_args, hf_model, import_args, tool, train

PROMPT = [5, 6, 7, 8]
NEW_TOKENS = 12
NULL_EOD = 60  # NullTokenizer --vocab-size 60: ids 0..59, end-of-document 60


def generate_cli(*args: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "generate.py"), *args, "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_exported_model_generates_like_tools_generate(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    save, _ = trained
    tool("convert_checkpoint").main(export_args(save, str(tmp_path / "hf")))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.activation_function == "gelu_new"  # trained with --openai-gelu
    assert hf.generation_config.eos_token_id == NULL_EOD
    expected = hf.generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    )[0, len(PROMPT) :].tolist()
    tokenizer = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "60"]
    ours = generate_cli(
        "--load", save, "--greedy", "--num-tokens-to-generate", str(NEW_TOKENS),
        "--stop-at-eod", *tokenizer,
        "--prompts", " ".join(map(str, PROMPT)), "--prompt-ids", " ".join(map(str, PROMPT)),
    )  # fmt: skip
    assert [o["ids"] for o in ours] == [expected, expected]
    assert ours[0]["text"] == " ".join(map(str, expected))


def test_sampling_is_seeded_and_top_k_1_is_greedy(trained):
    from megadyn.convert.generation import SamplingConfig, generate, load_model

    model = load_model(os.path.join(trained[0], "iter_0000003"))
    sample = SamplingConfig(greedy=False, temperature=0.7, top_k=5, top_p=0.9, seed=3)
    first = generate(model, PROMPT, NEW_TOKENS, sample)
    assert first == generate(model, PROMPT, NEW_TOKENS, sample)
    greedy = generate(model, PROMPT, NEW_TOKENS)
    assert generate(model, PROMPT, NEW_TOKENS, SamplingConfig(greedy=False, top_k=1)) == greedy


def test_top_k_top_p_filter_equals_transformers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from megadyn.convert.generation import filter_logits

    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 3
    for k, p in ((5, 1.0), (0, 0.7), (10, 0.5), (0, 0.999)):
        theirs = logits[None].clone()
        if k:
            theirs = TopKLogitsWarper(k)(None, theirs)
        if p < 1.0:
            theirs = TopPLogitsWarper(p)(None, theirs)
        assert torch.equal(filter_logits(logits, k, p).isinf(), theirs[0].isinf()), (k, p)


def test_imported_model_fine_tunes_from_its_weights(tmp_path):
    """The first loss of `pretrain_gpt.py --load <imported> --finetune` (tp 2) is the HF model's
    loss on the same first global batch: training starts from the imported weights."""
    from megadyn.training.arguments import parse_args
    from megadyn.training.data_setup import build_datasets, build_loader

    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = hf_model("GPT", seed=11, vocab_size=61, **no_dropout)
    model.save_pretrained(tmp_path / "hf")
    result = tool("convert_checkpoint").main(
        import_args(
            str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--target-tensor-parallel-size", "2"
        )
    )
    base = [a for a in TRAIN if a != "--openai-gelu"]
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads",
                 "--max-position-embeddings", "--make-vocab-size-divisible-by"):  # fmt: skip
        i = base.index(flag)
        del base[i : i + 2]  # the imported model's flags replace the job's
    argv = base + result["flags"] + ["--train-iters", "3", "--tensor-model-parallel-size", "2"]
    losses = train(2, argv + ["--load", str(tmp_path / "ckpt"), "--finetune"])

    cfg = parse_args(argv, world_size=2)
    assert cfg.model == result["cfg"]  # the printed flags build the imported model
    loader = build_loader(build_datasets(cfg).train, cfg, 0, 1, 0)
    micro = [loader.batch_at(i) for i in range(cfg.training.global_batch_size)]
    with torch.no_grad():
        per_micro = [
            torch.nn.functional.cross_entropy(model(b["tokens"]).logits[0], b["labels"][0])
            for b in micro
        ]
    assert abs(losses[0] - torch.stack(per_micro).mean().item()) < 1e-4
