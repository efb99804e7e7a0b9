"""Generate text from a megadyn checkpoint (saved under any layout) on one process, for sanity.

    python tools/generate.py --load ckpt/ --tokenizer-type GPTSentencePieceTokenizer \
        --tokenizer-model spm.model --prompts "def main" --num-tokens-to-generate 32 --greedy
    python tools/generate.py --load ckpt/ --prompt-ids "1 2 3" --temperature 0.8 --top-k 40 \
        --top-p 0.95 --seed 7 --json

Without --greedy, tokens are sampled (temperature, then top-k, then top-p). The output shows
each prompt and then what the model added to it, under headers:

    ----- prompt 1 of 2 -----
    def main
    ----- generated (32 tokens) -----
    (): ...

(token ids where there is no tokenizer). --json prints one line per prompt instead:
{"prompt": ..., "prompt_ids": [...], "ids": [...], "text": ...}.
"""

from __future__ import annotations

import argparse
import json
import sys

from megadyn.convert import ConversionError
from megadyn.convert.generation import SamplingConfig, generate, load_model
from megadyn.data import TOKENIZER_TYPES, build_tokenizer


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="megadyn checkpoint (root or iter_* directory)")
    p.add_argument("--prompts", nargs="*", default=[], help="prompt texts (need a tokenizer)")
    p.add_argument("--prompt-ids", nargs="*", default=[], help='prompts as token ids: "1 2 3"')
    p.add_argument("--num-tokens-to-generate", type=int, default=32)
    p.add_argument("--greedy", action="store_true", help="most likely token at each step")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k filtering")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = no nucleus filtering")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-at-eod", action="store_true", help="stop at the tokenizer's eod")
    p.add_argument("--json", action="store_true", help="one json line per prompt")
    t = p.add_argument_group("tokenizer (megadyn.data.build_tokenizer)")
    t.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES)
    t.add_argument("--tokenizer-model")
    t.add_argument("--vocab-file")
    t.add_argument("--merge-file")
    t.add_argument("--vocab-size", type=int, help="NullTokenizer's vocabulary")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[list[int]]:
    args = get_args(argv)
    tokenizer = None
    if args.tokenizer_type:
        tokenizer = build_tokenizer(
            args.tokenizer_type,
            tokenizer_model=args.tokenizer_model,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            vocab_size=args.vocab_size,
        )
    if args.prompts and tokenizer is None:
        raise ConversionError("--prompts needs --tokenizer-type (or give --prompt-ids)")
    prompts = [(text, tokenizer.tokenize(text)) for text in args.prompts]
    prompts += [(ids, [int(x) for x in ids.split()]) for ids in args.prompt_ids]
    if not prompts:
        raise ConversionError("nothing to generate from: give --prompts or --prompt-ids")
    sampling = SamplingConfig(
        greedy=args.greedy,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    model = load_model(args.load)
    stop = tokenizer.eod if (args.stop_at_eod and tokenizer is not None) else None
    outputs = []
    for number, (shown, prompt) in enumerate(prompts, start=1):
        ids = generate(model, prompt, args.num_tokens_to_generate, sampling, stop)
        new = ids[len(prompt) :]
        text = tokenizer.detokenize(new) if tokenizer is not None else None
        if args.json:
            print(json.dumps({"prompt": shown, "prompt_ids": prompt, "ids": new, "text": text}))
        else:
            print_sample(number, len(prompts), shown, new, text)
        outputs.append(ids)
    return outputs


def print_sample(number: int, count: int, prompt: str, new: list[int], text: str | None) -> None:
    """One prompt and its continuation under headers (a blank line before all but the first)."""
    if number > 1:
        print()
    print(f"----- prompt {number} of {count} -----")
    print(prompt)
    print(f"----- generated ({len(new)} tokens) -----")
    print(text if text is not None else " ".join(map(str, new)), flush=True)


if __name__ == "__main__":
    try:
        main()
    except (ConversionError, ValueError, FileNotFoundError) as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        sys.exit(2)
