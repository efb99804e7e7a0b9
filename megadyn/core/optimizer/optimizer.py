"""Mixed-precision Adam(W) over DDP gradient buffers, optionally sharded over dp (ZeRO-1).

    chunks = [DistributedDataParallel(c, groups.dp_cp_group, ...) for c in model_chunks]
    optimizer = build_optimizer(chunks, chunks, groups, OptimizerConfig(bf16=True))
    forward_backward(..., loss_scale=optimizer.loss_scale)   # fp16: the scaled loss
    finalize_model_grads(chunks, groups)
    result = optimizer.step()                # OptimizerStep: applied, grad_norm, num_zeros
    optimizer.zero_grad()

The optimizer works on *shards*: for every parameter, the contiguous range of its flattened
elements that this rank updates. Without the distributed optimizer that is the whole parameter;
with it, the intersection of the parameter with the part of its gradient bucket that this dp
rank owns (see `param_and_grad_buffer.py`), possibly empty. With several optimizer instances
(--num-distributed-optimizer-instances) the ranks of each instance shard it alike, so the
rank at the same place in another instance updates the same shard with the same gradient.
Each shard has an fp32 main copy
(for fp32 params, a view of the param itself) and its Adam moments, and torch's AdamW update
(adamw.py) takes the matching slice of `param.main_grad`. After the step, main copies are cast
back into the params and, with the distributed optimizer, all-gathered over dp.

With --use-precision-aware-optimizer a bf16 param's shard keeps an int16 remainder instead of
an fp32 copy (remainders.py): the step joins weight and remainder into fp32, updates them with
the same arithmetic and writes the new high half into the weight, the rest into the remainder.
The layout-free state below is the same fp32 main value in both modes, so checkpoints and
reshards go from one mode to the other exactly.

A failure watch that aborts the communicators (a peer died) first sets `interrupted`: a step
whose host reads (overflow check, grad norm) return after that raises `StepInterrupted` before
it changes any state, so the survivor still holds the previous step's tensors.

The state of one parameter (`param_state` / `load_param_state`) is given at the full local
(tp/pp-local) shape, independent of dp size and of the distributed optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megadyn.core.distributed import Bucket, DistributedDataParallel
from megadyn.core.groups import ParallelGroups
from megadyn.core.optimizer import clip_grads as stats
from megadyn.core.optimizer.adamw import SCRATCH_NUMEL, AdamHyper, adamw_update, set_adam_state
from megadyn.core.optimizer.config import OptimizerConfig
from megadyn.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megadyn.core.optimizer.remainders import model_weight
from megadyn.core.optimizer.shards import STATE_KEYS, ParamShard, gather_param_state, make_shards


class StepInterrupted(RuntimeError):
    """The communicators were aborted while the step waited on them: nothing was updated."""


@dataclass(frozen=True)
class OptimizerStep:
    """What one `MixedPrecisionOptimizer.step` did."""

    applied: bool
    """The update ran (False: the loss scaler found inf or nan and skipped it)."""
    grad_norm: float | None = None
    """The global gradient norm before clipping (None when skipped)."""
    num_zeros: int | None = None
    """Zeros in the gradients under --log-num-zeros-in-grad (else None)."""


class MixedPrecisionOptimizer:
    """fp32 main params (or remainders) + AdamW over this rank's shards; loss scaling,
    clipping, ZeRO-1."""

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        ddp_wrappers: Sequence[DistributedDataParallel],
        groups: ParallelGroups,
        config: OptimizerConfig,
        *,
        stats_group=None,
    ):
        """Gradient statistics (norm, zeros, overflow) sum over the layout's model-parallel
        group, and with the distributed optimizer over its shard group too. Replicas of
        different pipeline depth (megadyn/core/hetero_groups.py) pass `stats_group`, every
        member of the job: with the distributed optimizer each of them owns a distinct part of
        every gradient (of the tied output copy too), and the statistics sum over it alone;
        without it each replica holds the whole gradient and the default applies."""
        self.config = config
        self.groups = groups
        self.ddp_wrappers = list(ddp_wrappers)
        self.distributed = config.use_distributed_optimizer
        self.remainders = config.use_precision_aware_optimizer
        self.scratch_numel = SCRATCH_NUMEL  # fp32 joined at a time (remainders only)
        self.interrupted = False  # set by the runtime's failure watch (another thread)
        if any(d.use_distributed_optimizer != self.distributed for d in self.ddp_wrappers):
            raise ValueError(
                "--use-distributed-optimizer must be the same for the optimizer and every "
                "DistributedDataParallel chunk"
            )
        names = {p: n for chunk in chunks for n, p in chunk.named_parameters()}
        self.params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        self._bucket_of: dict[nn.Parameter, Bucket] = {}
        self.shards: list[ParamShard] = []
        for ddp in self.ddp_wrappers:
            for buffer in ddp.buffers:
                for bucket in buffer.buckets:
                    self._bucket_of.update(dict.fromkeys(bucket.params, bucket))
                    self.shards += make_shards(bucket, names, remainders=self.remainders)
        self._shard_of = {s.param: s for s in self.shards}
        missing = [names.get(p, "?") for p in self.params if p not in self._bucket_of]
        if missing:
            raise ValueError(f"parameters without a DDP gradient buffer: {missing}")

        self._lr, self._weight_decay = config.lr, config.weight_decay
        self._fused = bool(self.shards) and self.shards[0].param.is_cuda  # else foreach
        self._step_count = 0
        self.grad_scaler = None
        if config.loss_scale is not None:
            self.grad_scaler = ConstantGradScaler(config.loss_scale)
        elif config.fp16:
            self.grad_scaler = DynamicGradScaler(
                config.initial_loss_scale,
                config.min_loss_scale,
                config.loss_scale_window,
                config.hysteresis,
            )
        # groups over which gradient statistics are summed (see clip_grads.py): the distributed
        # optimizer's shards of one instance span the dp x cp ranks holding the same weights
        # (all of them with one instance; the other instances hold copies, counted once)
        self._count_tied_copy = stats_group is not None and self.distributed
        if self._count_tied_copy:
            self._stat_groups = [stats_group]
        else:
            shard_group = groups.intra_distopt_group
            self._stat_groups = [groups.mp_group] + ([shard_group] if self.distributed else [])

    # --- schedule hooks ---------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every shard."""
        self._lr = lr

    def get_lr(self) -> float:
        return self._lr

    def set_weight_decay(self, weight_decay: float) -> None:
        """Set the weight decay of the decayed group (biases and 1-D params stay at 0)."""
        self._weight_decay = weight_decay

    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 without a loss scaler)."""
        return float(self.grad_scaler.scale) if self.grad_scaler else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.grad_scaler else loss

    # --- the step ---------------------------------------------------------------------------
    def step(self) -> OptimizerStep:
        """Unscale, check overflow, clip, AdamW, copy back.

        A step skipped for overflow returns `OptimizerStep(applied=False)` and leaves the
        params as they were. Call after `finalize_model_grads`.
        """
        grads = [shard.grad() for shard in self.shards]
        device = self.params[0].device if self.params else None
        if self.grad_scaler is not None:
            inv_scale = self.grad_scaler.inv_scale
            found_inf = stats.unscale_and_check_finite(grads, inv_scale, self._stat_groups, device)
            self._stop_if_interrupted()
            self.grad_scaler.update(found_inf)
            if found_inf:
                return OptimizerStep(applied=False)
        tp_rank = self.groups.tp_rank
        counted = [
            g
            for s, g in zip(self.shards, grads)
            if stats.counts_in_norm(s.param, tp_rank, tied_copy=self._count_tied_copy)
        ]
        grad_norm = stats.global_grad_norm(counted, self._stat_groups, device)
        self._stop_if_interrupted()  # the norm's host read waited for the gradients
        clip = 1.0  # applied by the update as it reads the gradients (adamw.py)
        if self.config.clip_grad > 0:
            clip = stats.clip_coefficient(self.config.clip_grad, grad_norm)
        num_zeros = None
        if self.config.log_num_zeros_in_grad:
            num_zeros = stats.count_zeros(counted, self._stat_groups, device)
        betas = (self.config.adam_beta1, self.config.adam_beta2)
        hyper = AdamHyper(self._lr, self._weight_decay, betas, self.config.adam_eps)
        adamw_update(
            self.shards, grads, hyper, fused=self._fused, step=self._step_count + 1,
            scratch_numel=self.scratch_numel, grad_scale=clip,
        )  # fmt: skip
        self._step_count += 1
        self._copy_main_to_model()
        return OptimizerStep(applied=True, grad_norm=grad_norm, num_zeros=num_zeros)

    def _stop_if_interrupted(self) -> None:
        """Raise StepInterrupted if the runtime aborted the communicators meanwhile: the value
        just read on the host may come from a collective cut short, so nothing is updated."""
        if self.interrupted:
            raise StepInterrupted(
                "a peer failed while this step's gradients were reduced: the step stops "
                "before its update"
            )

    @torch.no_grad()
    def _copy_main_to_model(self) -> None:
        for shard in self.shards:  # remainders: the step wrote the model slice
            if shard.main is not None and shard.main.data_ptr() != shard.model_slice().data_ptr():
                shard.model_slice().copy_(shard.main)
        if self.distributed:
            for ddp in self.ddp_wrappers:
                ddp.all_gather_params()

    def zero_grad(self) -> None:
        """Zero the DDP gradient buffers (every `main_grad`)."""
        for ddp in self.ddp_wrappers:
            ddp.zero_grad_buffer()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Copy the model params into the main copies (after the params were set elsewhere)."""
        for shard in self.shards:
            shard.set_main(shard.model_slice().float())

    # --- layout-free state ------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Number of applied (not skipped) steps; Adam's bias correction uses it."""
        return self._step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._step_count = int(value)
        for shard in self.shards:
            if shard.adam:
                shard.adam["step"].fill_(float(value))

    @staticmethod
    def _state_of(shard: ParamShard) -> dict[str, torch.Tensor]:
        """{main, exp_avg, exp_avg_sq} of `shard` (moments zero before its first step)."""
        main = shard.main_value()
        return {
            "main": main,
            **{k: shard.adam.get(k, torch.zeros_like(main)) for k in STATE_KEYS[1:]},
        }

    def param_state(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        """{main, exp_avg, exp_avg_sq} of `param` as fp32 tensors of its full local shape.

        Collective over dp with the distributed optimizer (over this rank's instance under
        --num-distributed-optimizer-instances): every dp rank must call it for the same params
        in the same order.
        """
        shard = self._shard_of.get(param)
        pieces = []
        if shard is not None:
            pieces = list(self._state_of(shard).values())
        if self.distributed:
            bucket = self._bucket_of[param]
            flat = gather_param_state(bucket, param, pieces)
        else:
            flat = torch.stack(pieces)
        return {k: flat[i].reshape(param.shape).clone() for i, k in enumerate(STATE_KEYS)}

    @torch.no_grad()
    def load_param_state(self, param: nn.Parameter, state: dict[str, torch.Tensor]) -> None:
        """Set `param` and its main copy and Adam state from full local-shape tensors (no comm).

        The Adam step counter is `step_count`; set it (or `load_state_dict`) first.
        """
        main = state["main"].to(device=param.device, dtype=torch.float32).reshape(param.shape)
        remainders = self.remainders and param.dtype == torch.bfloat16
        param.detach().copy_(model_weight(main) if remainders else main)  # as every owner has it
        shard = self._shard_of.get(param)
        if shard is not None:
            self.load_shard_state(
                param, {k: state[k].reshape(-1)[shard.start : shard.end] for k in STATE_KEYS}
            )

    def shard_range(self, param: nn.Parameter) -> tuple[int, int]:
        """[start, end) of `param.view(-1)` whose fp32 state this rank keeps (empty: (0, 0))."""
        shard = self._shard_of.get(param)
        return (shard.start, shard.end) if shard is not None else (0, 0)

    def shard_state(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        """{main, exp_avg, exp_avg_sq} of this rank's range of `param`, flat fp32 (no comm):
        the optimizer's own tensors, except a main joined from a remainder (a new tensor)."""
        shard = self._shard_of.get(param)
        if shard is None:
            empty = torch.zeros(0, dtype=torch.float32, device=param.device)
            return dict.fromkeys(STATE_KEYS, empty)
        return self._state_of(shard)

    @torch.no_grad()
    def load_shard_state(self, param: nn.Parameter, state: dict[str, torch.Tensor]) -> None:
        """Set this rank's range of `param`'s fp32 state from flat tensors (no comm); the model
        param itself is set by the caller, except that with a remainder this sets the range's
        weight to the high half of the main value (weight and remainder make the main)."""
        shard = self._shard_of.get(param)
        if shard is None:
            return
        shard.set_main(state["main"])
        exp_avg, exp_avg_sq = (state[k] for k in STATE_KEYS[1:])
        set_adam_state(shard, exp_avg, exp_avg_sq, self._step_count, self._fused)

    def state_dict(self) -> dict:
        """{step, grad_scaler, params: [param_state(p) for p in self.params]} (collective)."""
        return {
            "step": self._step_count,
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
            "params": [self.param_state(p) for p in self.params],
        }

    def load_state_dict(self, state: dict) -> None:
        self.step_count = state["step"]
        if self.grad_scaler is not None and state.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        if len(state["params"]) != len(self.params):
            raise ValueError(
                f"optimizer state has {len(state['params'])} params, this model {len(self.params)}"
            )
        for param, param_state in zip(self.params, state["params"]):
            self.load_param_state(param, param_state)


def build_optimizer(
    chunks: Sequence[nn.Module],
    ddp_wrappers: Sequence[DistributedDataParallel],
    groups: ParallelGroups,
    config: OptimizerConfig,
    *,
    stats_group=None,
) -> MixedPrecisionOptimizer:
    """The optimizer of this rank's model chunks (wrapped in `ddp_wrappers`) under `groups`
    (`stats_group`: see `MixedPrecisionOptimizer`)."""
    return MixedPrecisionOptimizer(chunks, ddp_wrappers, groups, config, stats_group=stats_group)
