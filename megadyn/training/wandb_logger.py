"""Weights & Biases logging from the one rank that logs (the last, as Megatron's).

    logger = create_wandb_logger(cfg, rank, world_size)   # a no-op unless --wandb-project and last rank
    logger.log({"lm loss": 2.3, "learning-rate": 1e-4}, step=iteration)
    logger.log_event("reshard", {"old": "tp2pp2dp1", "new": "tp1pp1dp4", "seconds": 3.1})
    logger.finish()

Without WANDB_API_KEY the run is written offline (under <dir>/wandb/offline-run-*, upload later
with `wandb sync`); wandb never prompts for a login. WANDB_MODE, when set, is respected
(e.g. 'disabled'). When the run starts, the logging rank prints one line with its mode, project
and run directory (` W&B: offline run, project p, run dir ...`). `read_offline_history` and `read_offline_config`
read the logged points and the run config back from a run's `.wandb` file, for tests and tools.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megadyn.training.arguments import dump_args
from megadyn.training.config import MegadynConfig


class NullWandbLogger:
    """Stands in on ranks that do not log, and when --wandb-project is not given."""

    enabled = False
    run_dir: Path | None = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def log_event(self, name: str, data: dict[str, Any], step: int | None = None) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger(NullWandbLogger):
    """One W&B run: the flat job config as its config, metrics by iteration, events."""

    enabled = True

    def __init__(
        self,
        project: str,
        exp_name: str | None = None,
        save_dir: str | None = None,
        config: dict[str, Any] | None = None,
        mode: str | None = None,
    ) -> None:
        import wandb

        if mode is None:
            has_key = bool(os.environ.get("WANDB_API_KEY"))
            mode = os.environ.get("WANDB_MODE") or ("online" if has_key else "offline")
            if mode == "online" and not has_key:
                mode = "offline"  # online without a key would ask for a login
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
        self._run = wandb.init(
            project=project,
            name=exp_name or None,
            dir=save_dir or None,
            config=config or {},
            mode=mode,
            settings=wandb.Settings(silent=True, console="off"),
        )
        self._step = 0
        self.mode = mode
        self.project = project
        self.run_dir = Path(self._run.dir).parent  # .../wandb/<offline-run-...>

    def describe(self) -> str:
        """The console line that says W&B is on: mode, project, run directory (and how to upload
        an offline run, or where an online one is)."""
        if self.mode == "disabled":
            return f" W&B: disabled (WANDB_MODE=disabled), project {self.project}, nothing logged"
        line = f" W&B: {self.mode} run, project {self.project}, run dir {self.run_dir}"
        if self.mode == "offline":
            return line + f" (upload with: wandb sync {self.run_dir})"
        url = getattr(self._run, "url", None)
        return line + (f", {url}" if url else "")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record `metrics` at iteration `step` (steps must not go backwards)."""
        self._step = max(self._step, step)
        self._run.log(dict(metrics), step=self._step)

    def log_event(self, name: str, data: dict[str, Any], step: int | None = None) -> None:
        """Record a one-off event (a reshard, a member leaving) as `event/<name>/<key>` values."""
        values = {f"event/{name}/{key}": value for key, value in data.items()}
        self.log({f"event/{name}": 1, **values}, step=self._step if step is None else step)

    def finish(self) -> None:
        """End the run and stop wandb's service process, which is what makes the run's files
        complete on return (run.finish alone can leave the last records unwritten for a moment)."""
        import wandb

        self._run.finish()
        wandb.teardown()


def create_wandb_logger(
    cfg: MegadynConfig,
    rank: int,
    world_size: int,
    mode: str | None = None,
    print_fn: Callable[..., Any] = print,
) -> NullWandbLogger:
    """A WandbLogger on the last rank when --wandb-project is given, else a no-op logger.

    The run's config is `cfg` as given: pass the job's config after the tokenizer has set the
    model's vocabulary. The logging rank says on the console (`print_fn`) that W&B is on.
    """
    log = cfg.logging
    if not log.wandb_project or rank != world_size - 1:
        return NullWandbLogger()
    save_dir = log.wandb_save_dir
    if not save_dir and cfg.checkpoint.save:
        save_dir = os.path.join(cfg.checkpoint.save, "wandb")
    logger = WandbLogger(log.wandb_project, log.wandb_exp_name, save_dir, dump_args(cfg), mode)
    print_fn(logger.describe(), flush=True)
    return logger


def _offline_records(run_dir: str | Path):
    """The serialized `wandb_internal_pb2.Record`s of a run's `run-*.wandb` file, in order.

    The file is a W&B header (':W&B', magic, version: 7 bytes) followed by LevelDB-log records
    in 32 KiB blocks (crc32 4 bytes, length 2, type 1: full/first/middle/last).
    """
    from wandb.proto import wandb_internal_pb2

    (path,) = Path(run_dir).glob("run-*.wandb")
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    payload, pos, block = b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too short for a header: zero padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        payload = chunk if kind in (1, 2) else payload + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            yield record


def _items(items) -> dict[str, Any]:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def read_offline_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """The history rows ({'_step': 1, 'lm loss': 2.3, ...}) of a run's `run-*.wandb` file."""
    return [
        _items(r.history.item)
        for r in _offline_records(run_dir)
        if r.WhichOneof("record_type") == "history"
    ]


def read_offline_config(run_dir: str | Path) -> dict[str, Any]:
    """The run config ({'model.vocab_size': 61, ...}) of a run's `run-*.wandb` file."""
    config: dict[str, Any] = {}
    for record in _offline_records(run_dir):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update(_items(record.run.config.update))
        elif kind == "config":
            config.update(_items(record.config.update))
    return config
