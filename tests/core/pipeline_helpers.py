"""Helpers of test_pipeline.py: the reference model and gradient plumbing, and a simulator.

    ref_losses, ref_grads = reference(cfg, m, dp)   # single process, all micro batches
    finalize_grads(chunks, groups, cfg)              # what finalize_model_grads does
    grads = global_grads(chunks, groups, cfg)        # this rank's grads, global shapes
    simulate(forward_backward_interleaved, pp=4, vpp=2, m=8)

`simulate` runs a schedule for every rank without processes, against a recording
communicator that hands out placeholders for received tensors, then checks that
- per ordered pair of ranks, the n-th message sent is the n-th received, and every forward /
  backward consumed the activation / gradient of the right virtual stage and micro batch (with
  pp = 2 both directions share one pair, so a wrong posting order would show here);
- under rendezvous semantics (a batched exchange completes only when every one of its
  operations has its partner posted, as NCCL's grouped send/recv) no rank waits forever.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megadyn.core.pipeline.p2p import P2PCommunicator
from megadyn.models import GPTConfig, GPTModel, init_chunk, masked_mean
from megadyn.models.sharding import param_specs, tp_piece

SEED, BATCH, VOCAB = 1234, 2, 100


def make_cfg(variant: str, num_layers: int, seq: int = 8, **overrides) -> GPTConfig:
    common = dict(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=8,
        max_position_embeddings=seq,
    )
    common.update(overrides)
    if variant == "gpt2":
        return GPTConfig.gpt2(**common)
    return GPTConfig.llama(num_query_groups=2, ffn_hidden_size=48, **common)


def micro_batches(dp_rank: int, m: int, seq: int = 8, step: int = 0, transform=None) -> list[dict]:
    """Random micro batches of dp rank `dp_rank`, each passed through `transform` if given."""
    out = []
    for j in range(m):
        g = torch.Generator().manual_seed(100_000 * step + 1000 * dp_rank + j)
        out.append(
            dict(
                tokens=torch.randint(0, VOCAB, (BATCH, seq), generator=g),
                labels=torch.randint(0, VOCAB, (BATCH, seq), generator=g),
                loss_mask=(torch.rand(BATCH, seq, generator=g) > 0.2).float(),
                position_ids=torch.arange(seq).expand(BATCH, seq),
            )
        )
    return out if transform is None else [transform(batch) for batch in out]


def loss_fn(per_token_loss: torch.Tensor, batch: dict) -> torch.Tensor:
    return masked_mean(per_token_loss, batch["loss_mask"])


def reference_step(
    model: GPTModel, m: int, dp: int, seq: int = 8, step: int = 0, transform=None
) -> list:
    """Back-propagate the mean loss of all dp ranks' micro batches through the single-process
    model; return each dp rank's per-micro-batch losses."""
    device = next(model.parameters()).device
    losses = []
    for d in range(dp):
        losses.append([])
        for batch in micro_batches(d, m, seq, step, transform):
            b = {k: v.to(device) for k, v in batch.items()}
            per_token = model(
                b["tokens"],
                b["position_ids"],
                labels=b["labels"],
                document_ids=b.get("document_ids"),
            )
            loss = loss_fn(per_token, b)
            (loss / (m * dp)).backward()
            losses[-1].append(loss.detach())
    return losses


def reference(cfg: GPTConfig, m: int, dp: int):
    """Per-micro-batch losses of each dp rank and the gradient of the mean loss of all."""
    model = GPTModel(cfg)
    init_chunk(model, SEED)
    losses = reference_step(model, m, dp)
    return losses, {n: p.grad for n, p in model.named_parameters()}


def finalize_grads(chunks, groups, cfg) -> None:
    """What `finalize_model_grads` does, written out: sp over tp, tied embedding, dp mean."""
    for p in (p for c in chunks for p in c.parameters()):
        if groups.layout.sequence_parallel and getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=groups.tp_group)
        dist.all_reduce(p.grad, group=groups.dp_group)
        p.grad /= groups.dp_size
    tied = not cfg.untie_embeddings_and_output_weights
    if tied and groups.pp_size > 1 and (groups.is_first_stage or groups.is_last_stage):
        chunk = chunks[0] if groups.is_first_stage else chunks[-1]
        dist.all_reduce(chunk.embedding.word_embeddings.weight.grad, group=groups.embedding_group)


def global_grads(chunks, groups, cfg) -> dict[str, torch.Tensor]:
    """This rank's gradients (fp32, CPU), each assembled to its global shape over tp."""
    specs, tp = param_specs(cfg), groups.tp_size
    local = {n: p.grad.float().cpu() for c in chunks for n, p in c.named_parameters()}
    pieces = [None] * tp
    dist.all_gather_object(pieces, local, group=groups.tp_group)
    out = {}
    for name in local:
        full = torch.zeros(specs[name].shape)
        for r in range(tp):
            tp_piece(specs[name], cfg, tp, r).put(full, pieces[r][name])
        out[name] = full
    return out


def rel_error(actual, expected) -> float:
    """|actual - expected| / |expected| (norms, in fp32)."""
    actual, expected = actual.float().cpu(), expected.float().cpu()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def assert_rel(actual, expected, what: str, tol: float = 1e-5) -> None:
    err = rel_error(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


# --- schedule simulator ---------------------------------------------------------------------
class _Received:
    def __init__(self, channel: tuple[int, int], index: int):
        self.channel, self.index = channel, index


class _RecordingComm(P2PCommunicator):
    def __init__(self, rank: int, pp: int, log: dict):
        self.rank, self.pp, self.log = rank, pp, log
        self.is_first, self.is_last = rank == 0, rank == pp - 1
        self.rounds: list[list[tuple]] = []
        self._pending = []

    def send_recv(self, *, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        nxt, prev = (self.rank + 1) % self.pp, (self.rank - 1) % self.pp
        ops, received = [], [None, None]
        for peer, payload in ((nxt, send_next), (prev, send_prev)):
            if payload is not None:
                self.log.setdefault((self.rank, peer), [[], []])[0].append(payload)
                ops.append(("send", (self.rank, peer), len(self.log[self.rank, peer][0]) - 1))
        for slot, (peer, wanted) in enumerate(((prev, recv_prev), (nxt, recv_next))):
            if wanted:
                recvs = self.log.setdefault((peer, self.rank), [[], []])[1]
                received[slot] = _Received((peer, self.rank), len(recvs))
                recvs.append(received[slot])
                ops.append(("recv", (peer, self.rank), received[slot].index))
        self.rounds.append(ops)
        return tuple(received)


class _RecordingSteps:
    def __init__(self, rank, pp, vpp, m, forward_only, comm):
        self.comm, self.num_microbatches, self.forward_only = comm, m, forward_only
        self.groups = SimpleNamespace(pp_size=pp, pp_rank=rank)
        self.chunks = [None] * vpp
        self.rank, self.pp, self.vpp = rank, pp, vpp
        self.forwards, self.backwards = [0] * vpp, [0] * vpp
        self.held = [deque() for _ in range(vpp)]
        self.consumed: list[tuple] = []  # (placeholder, expected payload)

    def stage(self, c: int) -> int:
        return c * self.pp + self.rank

    def forward(self, c, x):
        mb = self.forwards[c]
        self.forwards[c] += 1
        s = self.stage(c)
        if s > 0:
            self.consumed.append((x, ("act", s - 1, mb)))
        if not self.forward_only:
            self.held[c].append(mb)
        return None if s == self.pp * self.vpp - 1 else ("act", s, mb)

    def backward(self, c, grad):
        mb = self.held[c].popleft()
        self.backwards[c] += 1
        s = self.stage(c)
        if s < self.pp * self.vpp - 1:
            self.consumed.append((grad, ("grad", s + 1, mb)))
        return None if s == 0 else ("grad", s, mb)

    def finish(self):
        m = self.num_microbatches
        assert self.forwards == [m] * self.vpp
        assert self.backwards == [0 if self.forward_only else m] * self.vpp
        return []


def simulate(schedule, pp: int, vpp: int, m: int, forward_only: bool = False) -> None:
    log: dict = {}
    ranks = []
    for rank in range(pp):
        comm = _RecordingComm(rank, pp, log)
        steps = _RecordingSteps(rank, pp, vpp, m, forward_only, comm)
        schedule(steps)
        ranks.append(steps)
    for channel, (sends, recvs) in log.items():
        assert len(sends) == len(recvs), f"{channel}: {len(sends)} sent, {len(recvs)} received"
    for steps in ranks:
        for placeholder, expected in steps.consumed:
            got = log[placeholder.channel][0][placeholder.index]
            assert got == expected, f"rank {steps.rank} used {got} where it needed {expected}"
    _check_no_deadlock([s.comm.rounds for s in ranks], log)


def _check_no_deadlock(rounds: list[list[list[tuple]]], log: dict) -> None:
    where = {}  # (kind, channel, index) -> round in which it is posted
    for rank, rank_rounds in enumerate(rounds):
        for r, ops in enumerate(rank_rounds):
            for kind, channel, index in ops:
                where[kind, channel, index] = (rank, r)
    current = [0] * len(rounds)
    while any(current[i] < len(rounds[i]) for i in range(len(rounds))):
        done = []
        for rank, rank_rounds in enumerate(rounds):
            if current[rank] == len(rank_rounds):
                continue
            partners = [
                where["recv" if kind == "send" else "send", channel, index]
                for kind, channel, index in rank_rounds[current[rank]]
            ]
            if all(r <= current[peer] for peer, r in partners):
                done.append(rank)
        assert done, f"deadlock: ranks stuck in rounds {current}"
        for rank in done:
            current[rank] += 1
