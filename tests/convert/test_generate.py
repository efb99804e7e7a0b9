"""tools/generate.py's plain output, and the documentation's tool commands (README.md and
docs/*.md) against the tools' flags."""

import glob
import os
import re
import shlex

import pytest
from convert_helpers import REPO, TEXTS, tool

from megadyn.data import build_tokenizer


def test_plain_output_echoes_each_prompt_and_separates_them(sp_trained, capsys):
    save, model = sp_trained
    prompts = [TEXTS[0][:15], TEXTS[3][:12]]
    outputs = tool("generate").main(
        ["--load", save, "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
         model, "--greedy", "--num-tokens-to-generate", "5", "--prompts", *prompts,
         "--prompt-ids", "5 6 7"]
    )  # fmt: skip
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    shown = [*prompts, "5 6 7"]
    prompt_ids = [tokenizer.tokenize(p) for p in prompts] + [[5, 6, 7]]
    blocks = []
    for number, (text, prompt, ids) in enumerate(zip(shown, prompt_ids, outputs), start=1):
        assert ids[: len(prompt)] == prompt and len(ids) == len(prompt) + 5
        blocks.append(
            f"----- prompt {number} of 3 -----\n{text}\n"
            f"----- generated (5 tokens) -----\n{tokenizer.detokenize(ids[len(prompt) :])}\n"
        )
    assert capsys.readouterr().out == "\n".join(blocks)


def readme_commands(script: str) -> list[list[str]]:
    """The documentation's `python tools/<script>` command lines (continuations joined), split."""
    pages = [os.path.join(REPO, "README.md")] + sorted(
        glob.glob(os.path.join(REPO, "docs", "*.md"))
    )
    text = "".join(open(p, encoding="utf-8").read() for p in pages).replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith(f"python tools/{script}")]


@pytest.mark.parametrize("script", ["generate", "convert_checkpoint"])
def test_readme_commands_use_the_tools_flags(script, capsys):
    with pytest.raises(SystemExit):
        tool(script).get_args(["--help"])
    usage = capsys.readouterr().out
    known = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", usage))
    commands = readme_commands(script)
    assert commands, f"the documentation shows no tools/{script}.py command"
    for command in commands:
        unknown = [a for a in command if a.startswith("--") and a not in known]
        assert not unknown, f"docs: {' '.join(command)}: {script}.py has no {unknown}"
