"""megadyn checkpoints read and written whole, from one process, without torch.distributed.

    ckpt = open_checkpoint("ckpt/")               # a root with a tracker, or an iter_* directory
    ckpt.cfg, ckpt.meta, ckpt.iteration           # GPTConfig from megadyn.json args + tensor shapes
    weights = load_weights(ckpt)                  # {global name: tensor at its global shape}
    write_checkpoint(root, weights, cfg, meta)    # root/iter_0000000 + tracker, loadable by any layout

A megadyn checkpoint is layout-free (megadyn/training/checkpoint.py): key `model.<name>` holds
the global tensor (in its split view), whatever layout wrote it, so writing every tensor whole
from one process gives a checkpoint that `pretrain_gpt.py --load` reads under any layout, and
DCP reads a whole tensor back from the pieces a multi-process save wrote.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from tqdm import tqdm

from megadyn.convert.errors import ConversionError
from megadyn.convert.hf_files import read_json
from megadyn.models.config import GPTConfig
from megadyn.models.sharding import ParamSpec, param_specs
from megadyn.training import checksums
from megadyn.training.checkpoint_dirs import STATE_FILE, TRACKER, iter_dir, latest_checkpoint
from megadyn.training.checkpoint_items import OPTIM_KEYS
from megadyn.training.checkpoint_reader import CheckpointError

WORD_EMBEDDING = "embedding.word_embeddings.weight"


@dataclass
class MegadynCheckpoint:
    path: str
    """The iter_* directory."""
    meta: dict[str, Any]
    """Its megadyn.json."""
    cfg: GPTConfig
    stored: dict[str, Any]
    """DCP metadata: key -> storage metadata (global size, dtype)."""

    @property
    def iteration(self) -> int:
        return int(self.meta.get("iteration", 0))

    @property
    def has_optimizer_state(self) -> bool:
        return any(k.startswith("optim.") for k in self.stored)


def _stored_view(spec: ParamSpec) -> tuple[int, ...]:
    return tuple(spec.view or spec.shape)


def open_checkpoint(path: str, flag: str = "--load-dir") -> MegadynCheckpoint:
    """The checkpoint at `path` (root or iter dir), checked against its own args and against
    the checksums recorded when it was saved (a checkpoint without them is said to be
    unverified, on stderr)."""
    found = path
    if not os.path.isfile(os.path.join(path, ".metadata")):
        found = latest_checkpoint(path, flag) if os.path.isdir(path) else None
        if found is None:
            raise ConversionError(
                f"{flag} {path}: no megadyn checkpoint (no {TRACKER}, no iter_* directory with "
                f"{STATE_FILE} and .metadata)"
            )
    meta = read_json(os.path.join(found, STATE_FILE))
    try:
        stored = dcp.FileSystemReader(found).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - any reader error: name the file
        raise ConversionError(f"{os.path.join(found, '.metadata')}: unreadable ({e})") from e
    cfg = config_from_args(meta.get("args") or {}, stored, found)
    check_model_tensors(cfg, stored, found)
    verify(found, meta, flag)
    return MegadynCheckpoint(found, meta, cfg, stored)


def verify(path: str, meta: dict[str, Any], flag: str) -> None:
    """Check every stored item of the checkpoint directory `path` against its checksums."""
    try:
        expected = checksums.Expected.of(meta)
        if expected is None:
            print(checksums.unverified(path), file=sys.stderr)
        else:
            expected.verify(path)
    except (CheckpointError, ValueError, OSError) as e:
        raise ConversionError(f"{flag} {path}: {e}") from None


def config_from_args(args: dict[str, Any], stored: dict[str, Any], source: str) -> GPTConfig:
    """GPTConfig from megadyn.json's flat args; the vocabulary from the stored embedding (the
    args hold the flag's value, the trainer uses the tokenizer's)."""
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    kw = {k[6:]: v for k, v in args.items() if k.startswith("model.") and k[6:] in fields}
    if not kw:
        raise ConversionError(f"{source}/{STATE_FILE}: no model.* entries in 'args'")
    if isinstance(kw.get("params_dtype"), str):
        kw["params_dtype"] = getattr(torch, kw["params_dtype"])
    key = "model." + WORD_EMBEDDING
    if key not in stored:
        raise ConversionError(f"{source}: checkpoint has no tensor {key!r}")
    kw["vocab_size"] = int(stored[key].size[0])
    try:
        return GPTConfig(**kw)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{source}/{STATE_FILE}: model args are invalid: {e}") from e


def check_model_tensors(cfg: GPTConfig, stored: dict[str, Any], source: str) -> None:
    """Every weight of `cfg` at its global shape, nothing else under model.*, and optimizer
    state either for every weight or for none."""
    specs = param_specs(cfg)
    for name, spec in specs.items():
        key = "model." + name
        if key not in stored:
            raise ConversionError(
                f"{source}: checkpoint has no tensor {key!r} (args say it exists)"
            )
        have, want = tuple(stored[key].size), _stored_view(spec)
        if have != want:
            raise ConversionError(
                f"{source}: tensor {key!r} has global shape {list(have)}, the args need {list(want)}"
            )
    extra = sorted(k for k in stored if k.startswith("model.") and k[6:] not in specs)
    if extra:
        raise ConversionError(f"{source}: tensors {extra[:3]} are not in the model of the args")
    if any(k.startswith("optim.") for k in stored):
        for name in specs:
            missing = [k for k in OPTIM_KEYS if f"optim.{name}.{k}" not in stored]
            if missing:
                raise ConversionError(
                    f"{source}: optimizer state optim.{name}.{missing[0]} missing"
                )


def load_weights(ckpt: MegadynCheckpoint, progress: bool = False) -> dict[str, torch.Tensor]:
    """Every weight whole, at its global shape and stored dtype (one DCP read per tensor)."""
    out = {}
    specs = param_specs(ckpt.cfg)
    for name, spec in tqdm(specs.items(), desc="reading", unit="tensor", disable=not progress):
        key = "model." + name
        dtype = ckpt.stored[key].properties.dtype
        item = {key: torch.empty(_stored_view(spec), dtype=dtype)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                dcp.load(item, checkpoint_id=ckpt.path, no_dist=True)
            except Exception as e:  # noqa: BLE001 - DCP wraps file errors
                raise ConversionError(f"{ckpt.path}: reading {key!r} failed: {e}") from e
        out[name] = item[key].reshape(spec.shape)
    return out


def write_checkpoint(
    root: str,
    weights: dict[str, torch.Tensor],
    cfg: GPTConfig,
    meta: dict[str, Any],
    iteration: int = 0,
) -> str:
    """root/iter_<iteration> with every weight whole, megadyn.json and the tracker file."""
    specs = param_specs(cfg)
    items = {}
    for name, spec in specs.items():
        t = weights[name]
        if tuple(t.shape) != spec.shape:
            raise ConversionError(f"{name}: shape {list(t.shape)}, expected {list(spec.shape)}")
        items["model." + name] = t.reshape(_stored_view(spec)).contiguous()
    path = iter_dir(root, iteration)
    os.makedirs(path, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writer = checksums.keep_write_results(dcp.FileSystemWriter(path))
        dcp.save(items, storage_writer=writer, no_dist=True)
    sums, _ = checksums.record(path, writer.results)
    write_meta(
        path, dict(meta, iteration=iteration, **{checksums.CHECKSUMS: checksums.manifest([sums])})
    )
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(str(iteration))
    return path


def write_meta(path: str, meta: dict[str, Any]) -> None:
    with open(os.path.join(path, STATE_FILE), "w") as f:
        json.dump(meta, f, indent=1)
