"""Reading and writing Hugging Face model directories (as `save_pretrained` writes them).

    src = HFDirectory("llama-dir")          # config.json + safetensors or torch files, sharded or not
    src.config; src.names; src.shape(name); src.get(name); src.file_of(name)
    write_hf_directory(out, config, tensors, generation_config)   # model.safetensors + json

Safetensors are opened lazily (a tensor is read when asked for); torch `.bin` files are
memory-mapped and read with `weights_only=True`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from megadyn.convert.errors import ConversionError

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError as e:
        raise ConversionError(f"{path}: no such file") from e
    except (OSError, ValueError) as e:
        raise ConversionError(f"{path}: unreadable json ({e})") from e


class HFDirectory:
    """The tensors of a HF model directory, by name, with the file that holds each."""

    def __init__(self, directory: str):
        if not os.path.isdir(directory):
            raise ConversionError(f"--load-dir {directory}: not a directory")
        self.directory = directory
        self.config = read_json(os.path.join(directory, "config.json"))
        self._files: dict[str, str] = {}  # tensor name -> file path
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._open: dict[str, Any] = {}
        found = next((f for f in WEIGHT_FILES if os.path.isfile(os.path.join(directory, f))), None)
        if found is None:
            raise ConversionError(
                f"--load-dir {directory}: no weights: expected one of {', '.join(WEIGHT_FILES)}"
            )
        files = [found]
        if found.endswith(".index.json"):
            index = read_json(os.path.join(directory, found))
            files = sorted(set(index.get("weight_map", {}).values()))
            if not files:
                raise ConversionError(f"{os.path.join(directory, found)}: empty weight_map")
        for name in files:
            self._index(os.path.join(directory, name))

    def _index(self, path: str) -> None:
        if not os.path.isfile(path):
            raise ConversionError(f"{path}: weight file listed in the index is missing")
        try:
            if path.endswith(".safetensors"):
                from safetensors import safe_open

                handle = safe_open(path, framework="pt")
                shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
            else:
                handle = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                shapes = {k: tuple(v.shape) for k, v in handle.items()}
        except Exception as e:  # noqa: BLE001 - any reader error: name the file
            raise ConversionError(f"{path}: unreadable weights file ({e})") from e
        self._open[path] = handle
        for k, shape in shapes.items():
            self._files[k] = path
            self._shapes[k] = shape

    @property
    def names(self) -> list[str]:
        return list(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def file_of(self, name: str) -> str:
        return self._files[name]

    def get(self, name: str) -> torch.Tensor:
        handle = self._open[self._files[name]]
        if isinstance(handle, dict):
            return handle[name]
        return handle.get_tensor(name)


def write_hf_directory(
    directory: str,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    generation_config: dict[str, Any] | None = None,
) -> None:
    """config.json, model.safetensors (one file) and generation_config.json in `directory`."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if generation_config:
        with open(os.path.join(directory, "generation_config.json"), "w") as f:
            json.dump(generation_config, f, indent=2, sort_keys=True)
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    save_file(contiguous, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
