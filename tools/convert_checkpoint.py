"""Convert checkpoints: Hugging Face GPT-2 / Llama <-> megadyn, and megadyn layout changes.

Flags follow Megatron-LM's tools/checkpoint/convert.py (--model-type, --loader, --saver,
--load-dir, --save-dir, --target-*-parallel-size):

    # HF -> megadyn (weights only; then: pretrain_gpt.py --load ckpt --finetune <printed flags>)
    python tools/convert_checkpoint.py --model-type llama --loader hf --saver megadyn \
        --load-dir llama-hf/ --save-dir ckpt/ --target-tensor-parallel-size 2
    # megadyn (any layout it was saved in) -> HF (AutoModelForCausalLM.from_pretrained reads it)
    python tools/convert_checkpoint.py --loader megadyn --saver hf --load-dir ckpt/ --save-dir hf/
    # megadyn -> megadyn for another layout
    python tools/convert_checkpoint.py --loader megadyn --saver megadyn --load-dir ckpt/ \
        --save-dir ckpt-tp4/ --target-tensor-parallel-size 4 --target-pipeline-parallel-size 2

megadyn checkpoints are layout-free: `pretrain_gpt.py --load` reads any of them under any
layout, so a layout change is only a check (heads, query groups, FFN, layers and vocabulary
divide over the target layout) and a copy that records the target flags in megadyn.json. Output
is written to a hidden temporary directory and renamed into --save-dir on success.
"""

from __future__ import annotations

import argparse
import sys

import torch

from megadyn.convert import ConversionError, export_hf, import_hf, relayout
from megadyn.convert.hf_configs import FAMILIES
from megadyn.convert.layouts import Target
from megadyn.training.checkpoint_dirs import CheckpointError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument(
        "--model-type", choices=FAMILIES, help="GPT (GPT-2 block) or llama; default: detected"
    )
    p.add_argument("--loader", choices=["hf", "megadyn"], required=True, help="input format")
    p.add_argument("--saver", choices=["megadyn", "hf"], required=True, help="output format")
    p.add_argument("--load-dir", required=True, help="HF model directory or megadyn checkpoint")
    p.add_argument("--save-dir", required=True, help="new (or empty) output directory")
    t = p.add_argument_group("target layout (megadyn saver)")
    t.add_argument("--target-tensor-parallel-size", type=int, default=1, metavar="N")
    t.add_argument("--target-pipeline-parallel-size", type=int, default=1, metavar="N")
    t.add_argument(
        "--target-num-layers-per-virtual-pipeline-stage", type=int, default=None, metavar="N"
    )
    t.add_argument("--target-data-parallel-size", type=int, default=1, metavar="N")
    t.add_argument(
        "--use-distributed-optimizer", action="store_true", help="recorded in megadyn.json args"
    )
    i = p.add_argument_group("import (--loader hf)")
    i.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="vocabulary padding multiple the model will be trained with (Megatron's flag)",
    )
    i.add_argument("--params-dtype", choices=DTYPES, help="weight dtype; default: the files'")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = get_args(argv)
    target = Target(
        tp=args.target_tensor_parallel_size,
        pp=args.target_pipeline_parallel_size,
        num_layers_per_virtual_pipeline_stage=args.target_num_layers_per_virtual_pipeline_stage,
        dp=args.target_data_parallel_size,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    progress = not args.no_progress
    route = (args.loader, args.saver)
    if route == ("hf", "megadyn"):
        result = import_hf(
            args.load_dir,
            args.save_dir,
            model_type=args.model_type,
            target=target,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            params_dtype=DTYPES.get(args.params_dtype),
            progress=progress,
        )
        print(f"saved {args.save_dir}; train or fine-tune it with pretrain_gpt.py flags:")
        print("  --load " + args.save_dir + " --finetune " + " ".join(result["flags"]))
    elif route == ("megadyn", "hf"):
        result = export_hf(
            args.load_dir, args.save_dir, model_type=args.model_type, progress=progress
        )
        print(f"saved {args.save_dir} (iteration {result['iteration']}, {result['family']})")
        print(f"tokenizer: {result['tokenizer'].message}")
    elif route == ("megadyn", "megadyn"):
        result = relayout(args.load_dir, args.save_dir, target, progress=progress)
        print(f"saved {args.save_dir}: loads with {target.flags}")
    else:
        raise ConversionError("--loader hf --saver hf: nothing to convert")
    return result


if __name__ == "__main__":
    try:
        main()
    except (ConversionError, CheckpointError) as e:
        print(f"convert_checkpoint.py: error: {e}", file=sys.stderr)
        sys.exit(2)
