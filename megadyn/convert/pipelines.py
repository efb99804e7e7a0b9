"""The three conversions of tools/convert_checkpoint.py, each checked before anything is written.

    import_hf(hf_dir, save_dir, target=Target(tp=2))   # --loader hf --saver megadyn
    export_hf(ckpt_dir, save_dir)                      # --loader megadyn --saver hf
    relayout(ckpt_dir, save_dir, Target(tp=4, pp=2))   # --loader megadyn --saver megadyn

An imported checkpoint holds weights only (no optimizer state, iteration 0): `pretrain_gpt.py
--load <save_dir>` (with or without --finetune) starts from these weights under any layout and
initializes the optimizer from them. A layout change is a checked copy, since megadyn
checkpoints are layout-free; the copy's megadyn.json records the target layout's flags.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

import torch
from tqdm import tqdm

from megadyn.convert.errors import ConversionError
from megadyn.convert.hf_configs import config_from_hf, config_to_hf, family_of, hf_family
from megadyn.convert.hf_files import HFDirectory, read_json, write_hf_directory
from megadyn.convert.hf_tokenizer import export_tokenizer, recorded_tokenizer
from megadyn.convert.hf_weights import (
    canonical_hf_name,
    expected_hf_shapes,
    is_ignored,
    weight_rules,
)
from megadyn.convert.layouts import Target, check_layout, job_args, model_flags
from megadyn.convert.megadyn_files import (
    WORD_EMBEDDING,
    load_weights,
    open_checkpoint,
    write_checkpoint,
    write_meta,
)
from megadyn.convert.output_dir import atomic_directory, check_output_dir
from megadyn.models.config import GPTConfig
from megadyn.training.checkpoint_dirs import TRACKER, iter_dir
from megadyn.training.config import DataConfig

ARCH_NAMES = {"GPT": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _check_model_type(model_type: str | None, family: str, source: str) -> None:
    if model_type is not None and model_type != family:
        raise ConversionError(
            f"--model-type {model_type}: {source} holds a {family} model ({ARCH_NAMES[family]})"
        )


def _check_hf_tensors(src: HFDirectory, cfg: GPTConfig, family: str) -> dict[str, str]:
    """{canonical HF name: name in the files}, after checking names and shapes against cfg."""
    expected = expected_hf_shapes(cfg, family)
    present = {canonical_hf_name(n, family): n for n in src.names}
    where = f"--load-dir {src.directory}"
    for name, shape in expected.items():
        if name not in present:
            raise ConversionError(
                f"{where}: tensor {name!r} is missing (a {ARCH_NAMES[family]} with this "
                "config.json needs it)"
            )
        have = src.shape(present[name])
        if have != shape:
            raise ConversionError(
                f"{src.file_of(present[name])}: tensor {present[name]!r} has shape {list(have)}, "
                f"config.json needs {list(shape)}"
            )
    for name, original in present.items():
        if name not in expected and not is_ignored(name, cfg):
            raise ConversionError(
                f"{src.file_of(original)}: unexpected tensor {original!r} (not in a "
                f"{ARCH_NAMES[family]} with this config.json; wrong config?)"
            )
    return present


def import_hf(
    load_dir: str,
    save_dir: str,
    *,
    model_type: str | None = None,
    target: Target | None = None,
    make_vocab_size_divisible_by: int = 128,
    params_dtype: torch.dtype | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """HF GPT-2 / Llama directory -> megadyn checkpoint (weights only, iteration 0)."""
    check_output_dir(save_dir, "--save-dir")
    if not os.path.isdir(load_dir):
        raise ConversionError(f"--load-dir {load_dir}: not a directory")
    source = os.path.join(load_dir, "config.json")
    hf_config = read_json(source)
    family = hf_family(hf_config, source)
    _check_model_type(model_type, family, load_dir)
    cfg = config_from_hf(hf_config, family, source)
    src = HFDirectory(load_dir)
    cfg = cfg.with_(make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    present = _check_hf_tensors(src, cfg, family)
    rules = weight_rules(cfg, family)
    dtype = params_dtype or src.get(present[rules[0].hf[0]]).dtype
    if not dtype.is_floating_point:
        raise ConversionError(f"--load-dir {load_dir}: weights of dtype {dtype} are not floating")
    cfg = cfg.with_(params_dtype=dtype)
    target = target or Target()
    layout = check_layout(cfg, target)
    weights = {}
    for rule in tqdm(rules, desc="converting", unit="tensor", disable=not progress):
        tensors = [src.get(present[n]) for n in rule.hf]
        weights[rule.name] = rule.to_megadyn(tensors).to(dtype).contiguous()
    data = None
    if os.path.isfile(os.path.join(load_dir, "tokenizer.json")):
        data = DataConfig(
            tokenizer_type="HuggingFaceTokenizer", tokenizer_model=os.path.abspath(load_dir)
        )
    meta = dict(
        args=job_args(cfg, target, data),
        layout=dataclasses.asdict(layout),
        model_flags=model_flags(cfg),
        converted_from=dict(
            loader="hf",
            load_dir=os.path.abspath(load_dir),
            architecture=ARCH_NAMES[family],
            hf_config=src.config,
        ),
    )
    with atomic_directory(save_dir, "--save-dir") as tmp:
        write_checkpoint(tmp, weights, cfg, meta, iteration=0)
    return dict(cfg=cfg, family=family, flags=meta["model_flags"], layout=layout)


def _special_tokens(meta: dict[str, Any], cfg: GPTConfig) -> dict[str, int | None]:
    """bos/eos/pad ids: the imported model's, else the training tokenizer's end-of-document."""
    hf = (meta.get("converted_from") or {}).get("hf_config")
    if hf is not None:
        return {k: hf.get(k) for k in SPECIAL_TOKENS}
    tokenizer, _ = recorded_tokenizer(meta.get("args") or {}, cfg.vocab_size)
    eod = int(tokenizer.eod) if tokenizer is not None else None
    return {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": None}


def export_hf(
    load_dir: str, save_dir: str, *, model_type: str | None = None, progress: bool = False
) -> dict[str, Any]:
    """megadyn checkpoint (any layout) -> HF directory (config.json + model.safetensors)."""
    check_output_dir(save_dir, "--save-dir")
    ckpt = open_checkpoint(load_dir)
    family = family_of(ckpt.cfg, os.path.join(ckpt.path, "megadyn.json"))
    _check_model_type(model_type, family, load_dir)
    weights = load_weights(ckpt, progress)
    dtype = weights[WORD_EMBEDDING].dtype
    tensors = {}
    for rule in tqdm(weight_rules(ckpt.cfg, family), desc="converting", disable=not progress):
        tensors.update(zip(rule.hf, rule.to_hf(weights[rule.name])))
    special = _special_tokens(ckpt.meta, ckpt.cfg)
    config = config_to_hf(ckpt.cfg, family, dtype, special)
    generation = {k: v for k, v in special.items() if v is not None} or None
    with atomic_directory(save_dir, "--save-dir") as tmp:
        write_hf_directory(tmp, config, tensors, generation)
        written = export_tokenizer(ckpt.meta.get("args") or {}, ckpt.cfg.vocab_size, tmp)
    return dict(cfg=ckpt.cfg, family=family, iteration=ckpt.iteration, tokenizer=written)


def relayout(load_dir: str, save_dir: str, target: Target, progress: bool = False) -> dict:
    """Check that the checkpoint loads under `target` and copy it, recording the layout."""
    check_output_dir(save_dir, "--save-dir")
    ckpt = open_checkpoint(load_dir)
    layout = check_layout(ckpt.cfg, target)
    args = dict(ckpt.meta.get("args") or {})
    args.update(
        {
            "parallel.tp": target.tp,
            "parallel.pp": target.pp,
            "parallel.num_layers_per_virtual_pipeline_stage": (
                target.num_layers_per_virtual_pipeline_stage
            ),
            "optimizer.use_distributed_optimizer": target.use_distributed_optimizer,
        }
    )
    meta = dict(ckpt.meta, args=args, layout=dataclasses.asdict(layout))
    meta["relayout_from"] = dict(
        load_dir=os.path.abspath(ckpt.path), layout=ckpt.meta.get("layout")
    )
    files = sorted(f for f in os.listdir(ckpt.path) if f != "megadyn.json")
    with atomic_directory(save_dir, "--save-dir") as tmp:
        out = iter_dir(tmp, ckpt.iteration)
        os.makedirs(out)
        for name in tqdm(files, desc="copying", unit="file", disable=not progress):
            shutil.copy2(os.path.join(ckpt.path, name), os.path.join(out, name))
        write_meta(out, meta)
        with open(os.path.join(tmp, TRACKER), "w") as f:
            f.write(str(ckpt.iteration))
    return dict(cfg=ckpt.cfg, layout=layout, iteration=ckpt.iteration)
