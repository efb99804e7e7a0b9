"""The documents inside a packed sample: positions, attention and loss that stop at each EOD.

A sample is a window of tokens that runs across documents, each ended by the tokenizer's EOD
token. The flags of Megatron's data arguments make the model treat the documents apart:

    --reset-position-ids    positions restart at 0 after each EOD
    --reset-attention-mask  a token attends to earlier tokens of its own document only
    --eod-mask-loss         the loss of positions whose input token is EOD (the prediction of
                            the next document's first token) is masked out

The EOD token belongs to the document it ends. For tokens [a b EOD c d EOD e] (eod = EOD):

    document_ids  [0 0 0 1 1 1 2]
    position_ids  [0 1 2 0 1 2 0]
    loss_mask     [1 1 0 1 1 0 1]

    masking = DocumentMasking(eod, reset_position_ids=True, reset_attention_mask=True)
    batch = masking(batch)     # a collated micro batch of [b, S] tensors, whole sequences

`document_ids` [b, S] (added under --reset-attention-mask) is non-decreasing along each
sample; attention (megadyn/models/document_attention.py, and the context-parallel ring) keeps
a key for a query when both have the same id. It is computed before a sequence is split over
context-parallel ranks, so ids and positions are those of the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, S] int64: the index of each token's document within its sample (EODs before it)."""
    is_eod = (tokens == eod).long()
    return is_eod.cumsum(-1) - is_eod


def document_positions(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, S] int64: each token's position within its document."""
    s = tokens.shape[-1]
    index = torch.arange(s, device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[..., 1:] = tokens[..., :-1] == eod  # a document starts after each EOD
    start_of_doc = torch.where(starts, index, 0).cummax(-1).values  # [b, S]
    return index - start_of_doc


@dataclass(frozen=True)
class DocumentMasking:
    """What the document flags do to a micro batch (see the module docstring)."""

    eod: int
    """The tokenizer's end-of-document token id."""
    reset_position_ids: bool = False
    """Positions restart after each EOD (--reset-position-ids)."""
    reset_attention_mask: bool = False
    """Attention stays within each document (--reset-attention-mask)."""
    eod_mask_loss: bool = False
    """No loss at positions whose input token is EOD (--eod-mask-loss)."""

    @property
    def active(self) -> bool:
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`batch` with its positions, document ids and loss mask as the flags say."""
        tokens = batch["tokens"]
        out = dict(batch)
        if self.reset_position_ids:
            out["position_ids"] = document_positions(tokens, self.eod)
        if self.reset_attention_mask:
            out["document_ids"] = document_ids(tokens, self.eod)
        if self.eod_mask_loss:
            keep = (tokens != self.eod).to(batch["loss_mask"].dtype)
            out["loss_mask"] = batch["loss_mask"] * keep
        return out
