"""GPT model chunks: the part of the network one (virtual) pipeline stage runs.

    chunks = build_gpt_chunks(cfg, groups, recompute_cfg, tracker, device)   # one per virtual stage
    loss = chunks[0](tokens, labels=labels)     # pp 1: per-token loss [b, s]

A chunk embeds tokens if it is the first stage (`pre_process`), runs its global layers
(named `decoder.layers.<global index>`), and, if it is the last stage (`post_process`), applies
the final norm, the vocab-parallel output layer and the vocab-parallel cross entropy. Parameter
names are the global names of megadyn/models/sharding.py, whatever the layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megadyn.core.context_parallel import all_reduce_sum, local_positions
from megadyn.core.layout import LayoutError, chunk_layer_range
from megadyn.core.recompute import RecomputeConfig, run_layers
from megadyn.core.tensor_parallel import (
    ColumnParallelLinear,
    RNGTracker,
    VocabParallelEmbedding,
    chunked_output_loss,
    group_rank,
    group_size,
    mark_param,
    scatter_to_sequence,
    vocab_parallel_cross_entropy,
    vocab_range,
)
from megadyn.models.config import GPTConfig
from megadyn.models.document_attention import DocumentMask
from megadyn.models.sharding import init_global, param_specs, tp_piece
from megadyn.models.transformer import Norm, TransformerLayer, hidden_dropout, rope_tables


class Embedding(nn.Module):
    """Word (vocab-parallel) and learned position embeddings; output [s(/tp), b, h]."""

    def __init__(
        self,
        cfg: GPTConfig,
        tp_group,
        sequence_parallel,
        tracker,
        dtype,
        device,
        word_only: bool = False,
    ):
        super().__init__()
        self.cfg, self.tp_group, self.tracker = cfg, tp_group, tracker
        self.sequence_parallel = sequence_parallel
        padded = cfg.padded_vocab_size(group_size(tp_group))
        self.word_embeddings = VocabParallelEmbedding(
            cfg.vocab_size,
            padded,
            cfg.hidden_size,
            tp_group,
            sequence_parallel=sequence_parallel,
            # untied only: a tied table's gradient has a second term, the output layer's, which
            # autograd sums with the lookup's before the DDP hook adds the sum
            grad_accumulation_fusion=(
                cfg.gradient_accumulation_fusion and cfg.untie_embeddings_and_output_weights
            ),
            dtype=dtype,
            device=device,
        )
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned_absolute" and not word_only:
            self.position_embeddings = nn.Embedding(
                cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype, device=device
            )
            mark_param(self.position_embeddings.weight)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(tokens)  # [s(/tp), b, h]
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            pos = self.position_embeddings(position_ids.t())  # [s, b, h], replicated over tp
            if self.sequence_parallel:
                pos = scatter_to_sequence(pos, self.tp_group)  # [s/tp, b, h]
            x = x + pos
        return hidden_dropout(
            x, self.cfg.hidden_dropout, self.training, self.sequence_parallel, self.tracker
        )


class GPTModel(nn.Module):
    """One model chunk: layers `layer_range`, with embedding and/or head at the ends."""

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        tp_group=None,
        cp_group=None,
        sequence_parallel: bool = False,
        layer_range: range | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        recompute_cfg: RecomputeConfig | None = None,
        tracker: RNGTracker | None = None,
        device=None,
    ):
        super().__init__()
        self.cfg, self.tp_group, self.tracker = cfg, tp_group, tracker
        self.cp_group = cp_group if group_size(cp_group) > 1 else None
        self.sequence_parallel = sequence_parallel
        self.pre_process, self.post_process = pre_process, post_process
        self.recompute_cfg = recompute_cfg or RecomputeConfig()
        dtype = cfg.params_dtype
        layer_range = range(cfg.num_layers) if layer_range is None else layer_range
        tied = not cfg.untie_embeddings_and_output_weights
        if pre_process or (post_process and tied):
            self.embedding = Embedding(
                cfg, tp_group, sequence_parallel, tracker, dtype, device, word_only=not pre_process
            )
            if not pre_process:  # the last stage's copy of the tied weight
                self.embedding.word_embeddings.weight.shared_embedding = True
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleDict(
            {
                str(i): TransformerLayer(
                    cfg,
                    tp_group,
                    sequence_parallel,
                    tracker,
                    self.recompute_cfg,
                    dtype,
                    device,
                    cp_group=self.cp_group,
                )
                for i in layer_range
            }
        )
        if post_process:
            self.decoder.final_layernorm = Norm(cfg, sequence_parallel, dtype, device)
            tp, rank = group_size(tp_group), group_rank(tp_group)
            self.vocab_start, vocab_end = vocab_range(
                cfg.vocab_size, cfg.padded_vocab_size(tp), rank, tp
            )
            self.output_layer = ColumnParallelLinear(
                cfg.hidden_size,
                cfg.vocab_size,
                tp_group,
                bias=False,
                sequence_parallel=sequence_parallel,
                local_output_size=vocab_end - self.vocab_start,
                skip_weight=tied,
                grad_accumulation_fusion=cfg.gradient_accumulation_fusion,
                comm_overlap=cfg.comm_overlap,
                dtype=dtype,
                device=device,
            )
        self._rope_cache: tuple | None = None

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return not self.cfg.untie_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self):
        """The word embedding weight tied to the output layer, on the stages that hold it."""
        if not self.share_embeddings_and_output_weights or not hasattr(self, "embedding"):
            return None
        return self.embedding.word_embeddings.weight

    def local_positions(self, seq_len: int, device) -> torch.Tensor | None:
        """Global positions [s] of this rank's `seq_len` tokens under context parallelism
        (None without it: positions 0 .. seq_len - 1)."""
        if self.cp_group is None:
            return None
        cp = group_size(self.cp_group)
        return local_positions(seq_len * cp, group_rank(self.cp_group), cp, device)

    def rope(self, seq_len: int, device, position_ids=None, dynamic_cp: bool = False):
        """Rotary tables of this rank's `seq_len` tokens (their global positions under cp); of
        each sample's `position_ids` [b, s] under --reset-position-ids and dynamic cp."""
        if self.cfg.position_embedding_type != "rope":
            return None
        if (self.cfg.reset_position_ids or dynamic_cp) and position_ids is not None:
            cfg = self.cfg
            return rope_tables(
                seq_len, cfg.head_dim, cfg.rotary_base, device, cfg.params_dtype, position_ids
            )
        if (
            self._rope_cache is None
            or self._rope_cache[0].shape[0] != seq_len
            or self._rope_cache[0].device != device
        ):
            self._rope_cache = rope_tables(
                seq_len,
                self.cfg.head_dim,
                self.cfg.rotary_base,
                device,
                self.cfg.params_dtype,
                positions=self.local_positions(seq_len, device),
            )
        return self._rope_cache

    def forward(
        self,
        tokens=None,
        position_ids=None,
        labels=None,
        hidden_states=None,
        document_ids=None,
        cp_placement=None,
    ):
        """Returns per-token loss [b, s] (last stage, with labels), logits [s, b, V/tp] (last
        stage, no labels) or hidden states [s(/tp), b, h] (other stages). Under context
        parallelism the tokens are this rank's part of the sequence (context_parallel's
        `split_batch`) and `position_ids`, if given, their global positions. `document_ids`
        [b, S] (--reset-attention-mask; the whole sequence's under cp) keeps attention within
        each document. `cp_placement` (--cp-placement dynamic; context_parallel's
        `split_batch_dynamic`) says which blocks of the sequence this rank's tokens are."""
        if self.pre_process and position_ids is None and self.cp_group is not None:
            position_ids = self.local_positions(tokens.shape[1], tokens.device).expand_as(tokens)
        x = self.embedding(tokens, position_ids) if self.pre_process else hidden_states
        seq_len = x.shape[0] * (group_size(self.tp_group) if self.sequence_parallel else 1)
        layers = list(self.decoder.layers.values())
        documents = None
        if document_ids is not None or cp_placement is not None:
            # under --cp-comm-type a2a each rank attends over the whole sequence, as without cp
            cp = self.cp_group is not None and self.cfg.cp_comm_type != "a2a"
            documents = DocumentMask.build(document_ids, cp, cp_placement if cp else None)
        rope = self.rope(seq_len, x.device, position_ids, dynamic_cp=cp_placement is not None)
        x = run_layers(layers, x, self.recompute_cfg, self.tracker, rope=rope, documents=documents)
        if not self.post_process:
            return x
        x = self.decoder.final_layernorm(x)
        weight = (
            None if self.output_layer.weight is not None else self.embedding.word_embeddings.weight
        )
        fused = self.cfg.fused_loss if self.cfg.fused_loss is not None else x.is_cuda
        if labels is not None and self.cfg.cross_entropy_chunks > 1:  # no whole logits
            out = self.output_layer
            loss = chunked_output_loss(
                x,
                out.weight if weight is None else weight,
                labels.t(),
                self.vocab_start,
                self.tp_group,
                chunks=self.cfg.cross_entropy_chunks,
                fused=fused,
                fuse=weight is None and out.grad_accumulation_fusion,
                sequence_parallel=self.sequence_parallel,
            )
            return loss.t()  # [b, s]
        logits = self.output_layer(x, weight)  # [s, b, V/tp]
        if labels is None:
            return logits
        loss = vocab_parallel_cross_entropy(
            logits, labels.t(), self.vocab_start, self.tp_group, fused=fused
        )
        return loss.t()  # [b, s]


@torch.no_grad()
def init_chunk(chunk: GPTModel, seed: int) -> None:
    """Fill every weight of `chunk` with its piece of the layout-independent global init."""
    specs = param_specs(chunk.cfg)
    tp, rank = group_size(chunk.tp_group), group_rank(chunk.tp_group)
    for name, param in chunk.named_parameters():
        spec = specs[name]
        piece = tp_piece(spec, chunk.cfg, tp, rank)
        param.copy_(piece.take(init_global(spec, chunk.cfg, seed, param.device)))


def build_gpt_chunks(
    cfg: GPTConfig,
    groups,
    *,
    recompute_cfg: RecomputeConfig | None = None,
    tracker: RNGTracker | None = None,
    seed: int | None = None,
    device=None,
    stage_layers: tuple[range, ...] | None = None,
) -> list[GPTModel]:
    """The model chunks this rank runs under `groups.layout` (one per virtual stage).
    `stage_layers` (one range per pipeline stage, no virtual stages) replaces the layout's even
    split: a pipeline template's stages (megadyn/core/hetero_layout.py)."""
    layout = groups.layout
    if stage_layers is not None and (len(stage_layers) != layout.pp or layout.vpp != 1):
        raise LayoutError(
            f"{len(stage_layers)} stage layer ranges for a pipeline of {layout.pp} stages "
            f"x {layout.vpp} virtual stages (templates have no virtual stages)"
        )
    layout.validate(
        # uneven template stages need no divisibility: ranges checked by HeteroLayout
        num_layers=cfg.num_layers if stage_layers is None else layout.pp,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
    )
    chunks = []
    for c in range(layout.vpp):
        if stage_layers is None:
            layer_range = chunk_layer_range(layout, cfg.num_layers, groups.pp_rank, c)
        else:
            layer_range = stage_layers[groups.pp_rank]
        chunk = GPTModel(
            cfg,
            tp_group=groups.tp_group,
            cp_group=groups.cp_group,
            sequence_parallel=layout.sequence_parallel,
            layer_range=layer_range,
            pre_process=groups.pp_rank == 0 and c == 0,
            post_process=groups.pp_rank == layout.pp - 1 and c == layout.vpp - 1,
            recompute_cfg=recompute_cfg,
            tracker=tracker,
            device=device,
        )
        if seed is not None:
            init_chunk(chunk, seed)
        chunks.append(chunk)
    return chunks


def masked_mean(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean loss over the tokens the mask keeps: the loss of one micro batch."""
    mask = loss_mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def lm_loss(per_token_loss: torch.Tensor, batch: dict) -> torch.Tensor:
    """A micro batch's language-model loss: the mean over its `loss_mask` tokens (the loss
    function of training and evaluation)."""
    return masked_mean(per_token_loss, batch["loss_mask"])


def sequence_masked_mean(
    per_token_loss: torch.Tensor, loss_mask: torch.Tensor, cp_group
) -> torch.Tensor:
    """`masked_mean` over whole sequences split over `cp_group`: the sum of the cp ranks'
    masked sums over their total mask, the same value on every cp rank. Its gradient reaches
    each rank's tokens times cp (the sum is differentiable), which the gradient reduction's
    average over dp x cp takes back out."""
    mask = loss_mask.to(per_token_loss.dtype)
    sums = torch.stack([(per_token_loss * mask).sum(), mask.sum()])  # [loss sum, tokens]
    total = all_reduce_sum(sums, cp_group)
    return total[0] / total[1].clamp(min=1.0)


def lm_loss_for(cp_group) -> Callable[[torch.Tensor, dict], torch.Tensor]:
    """The loss function of a layout: `lm_loss`, over the whole sequence under context
    parallelism (`cp_group` of size > 1)."""
    if group_size(cp_group) == 1:
        return lm_loss

    def loss(per_token_loss: torch.Tensor, batch: dict) -> torch.Tensor:
        return sequence_masked_mean(per_token_loss, batch["loss_mask"], cp_group)

    return loss
