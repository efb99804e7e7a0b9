"""Context parallelism equals the single-process model: logits, loss and every gradient, for
cp 2 and 4 alone, cp 2 with tp 2 (with and without sequence parallelism), with dp 2 and with
pp 2 (also interleaved), the three --cp-comm-type variants, GPT-2 (learned positions) and Llama
(RoPE, grouped queries); and with full and selective recomputation (Llama, ring).

One spawned job of 4 processes runs every case (a layout over ranks [0, 1] leaves 2 and 3 out,
as standby processes); the gradients go through the training path: the pipeline's micro-batch
steps (which take each rank's chunks of the batch), DDP over dp x cp and finalize_model_grads.

The same job runs the document-masked cases (--reset-position-ids, --reset-attention-mask,
--eod-mask-loss on packed samples): cp 2 and 4 with the three comm types, tp 2 with sequence
parallelism, pp 2, selective recomputation, the ring's fused kernel run once per document
(--attention-backend flash: torch's CPU flash kernels), against the single-process model
under the same masks.
"""

import pytest
import torch
import torch.distributed as dist

from megadyn.core.context_parallel import local_positions, split_batch
from megadyn.core.distributed import DistributedDataParallel, finalize_model_grads
from megadyn.core.groups import ParallelGroups
from megadyn.core.layout import Layout
from megadyn.core.pipeline import PipelineConfig, forward_backward
from megadyn.core.recompute import RecomputeConfig
from megadyn.data.documents import DocumentMasking
from megadyn.models import GPTModel, build_gpt_chunks, init_chunk, lm_loss_for
from megadyn.testing import spawn
from tests.core.pipeline_helpers import (
    SEED,
    assert_rel,
    global_grads,
    make_cfg,
    micro_batches,
    reference_step,
)

SEQ, M = 16, 2
ALL, BOTH, THREE = [0, 1, 2, 3], ("p2p", "all_gather"), ("p2p", "all_gather", "a2a")
CASES = [  # (layout, members, model variant, --cp-comm-types); a2a where cp divides the
    # key/value heads per tp rank (gpt2: 4, llama: 2)
    (Layout(cp=2), [0, 1], "gpt2", ("p2p",)),
    (Layout(cp=2), [0, 1], "llama", THREE),
    (Layout(cp=4), ALL, "gpt2", ("p2p", "a2a")),
    (Layout(cp=4), ALL, "llama", BOTH),
    (Layout(tp=2, cp=2), ALL, "gpt2", ("all_gather", "a2a")),
    (Layout(tp=2, cp=2), ALL, "llama", ("p2p",)),
    (Layout(tp=2, cp=2, sequence_parallel=True), ALL, "llama", BOTH),
    (Layout(tp=2, cp=2, sequence_parallel=True), ALL, "gpt2", ("a2a",)),
    (Layout(cp=2, dp=2), ALL, "gpt2", ("p2p",)),
    (Layout(cp=2, dp=2), ALL, "llama", ("all_gather", "a2a")),
    (Layout(cp=2, pp=2), ALL, "llama", ("p2p", "a2a")),
    (Layout(cp=2, pp=2, vpp=2), ALL, "gpt2", ("p2p",)),
]
DOC_CASES = [  # (layout, members, model variant, --cp-comm-types) with document masking
    (Layout(cp=2), [0, 1], "llama", THREE),
    (Layout(cp=4), ALL, "gpt2", THREE),
    (Layout(tp=2, cp=2, sequence_parallel=True), ALL, "llama", BOTH),
    (Layout(cp=2, pp=2), ALL, "gpt2", ("p2p",)),
    (Layout(tp=2, pp=2, sequence_parallel=True), ALL, "llama", ("p2p",)),  # cp 1
]
EOD = 7
DOCUMENTS = DocumentMasking(
    EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True
)


def packed(batch: dict) -> dict:
    """`batch` made a packed sample: EODs at 3 (the first cp 2 chunk is one document, so ring
    blocks without a shared document are skipped), 6 and 11 (sample 0) or 12 (sample 1), then
    the document flags applied."""
    tokens = batch["tokens"].clone()
    tokens[:, [3, 6]] = EOD
    tokens[0, 11] = tokens[1, 12] = EOD
    return DOCUMENTS({**batch, "tokens": tokens})


LAYERS = 4
RECOMPUTE = [  # the ring's exchanges run again in the backward pass; on ranks 0 and 1 only, as
    # torch's checkpoint costs seconds of imports at its first use in a process
    RecomputeConfig("full", "uniform", 1),
    RecomputeConfig("selective"),
]


def gathered_logits(model, batch, groups) -> torch.Tensor:
    """Logits [S, b, V] of the whole sequence, from every tp and cp rank's pieces (those of
    its dynamic placement when `batch` has one, --cp-placement dynamic)."""
    placement = batch.get("cp_placement")
    extra = {} if placement is None else {"cp_placement": placement}
    with torch.no_grad():  # [s/cp, b, V/tp]
        local = model(
            batch["tokens"], batch["position_ids"], document_ids=batch.get("document_ids"), **extra
        )
    pieces = [None] * groups.tp_size
    dist.all_gather_object(pieces, local, group=groups.tp_group)
    local = torch.cat(pieces, dim=-1)  # [s/cp, b, V]
    pieces = [None] * groups.cp_size
    dist.all_gather_object(pieces, local, group=groups.cp_group)
    full = torch.empty((SEQ,) + local.shape[1:])
    for r, piece in enumerate(pieces):
        if placement is None:
            full[local_positions(SEQ, r, groups.cp_size)] = piece
        else:
            full[placement.token_index(r)] = piece
    return full


def run_case(
    layout, members, variant, comm_type, references, recompute=None, documents=False, backend="auto"
) -> None:
    groups = ParallelGroups.build(layout, members)
    if not groups.is_member:
        return groups.destroy()
    cfg = make_cfg(
        variant, LAYERS, seq=SEQ, cp_comm_type=comm_type, reset_position_ids=documents,
        attention_backend=backend,
    )  # fmt: skip
    chunks = build_gpt_chunks(cfg, groups, recompute_cfg=recompute, seed=SEED)
    ddp = [DistributedDataParallel(chunk, groups.dp_cp_group) for chunk in chunks]
    batches = micro_batches(groups.dp_rank, M, SEQ, transform=packed if documents else None)
    losses = forward_backward(
        ddp,
        groups,
        iter(batches),
        M,
        config=PipelineConfig(hidden_size=cfg.hidden_size, dtype=cfg.params_dtype),
        loss_fn=lm_loss_for(groups.cp_group),
    )
    finalize_model_grads(ddp, groups)
    what = f"{layout} {variant} {comm_type} {recompute} {backend}" + (
        " documents" if documents else ""
    )
    ref_model, ref_losses, ref_grads = references[(variant, layout.dp, documents)]
    if groups.is_last_stage:
        # (assert_close would import torch.distributed.tensor: seconds in every process)
        assert_rel(torch.stack(losses), torch.stack(ref_losses[groups.dp_rank]), f"{what} loss")
    for p in (p for chunk in chunks for p in chunk.parameters()):
        p.grad = p.main_grad  # the reduced gradient, where global_grads reads it
    for name, grad in global_grads(chunks, groups, cfg).items():  # this stage's weights
        assert_rel(grad, ref_grads[name], f"{what} grad {name}")
    if layout.pp == 1:
        batch = split_batch(batches[0], groups.cp_rank, groups.cp_size)
        full = batches[0]
        with torch.no_grad():
            ref_logits = ref_model(
                full["tokens"], full["position_ids"], document_ids=full.get("document_ids")
            )
        assert_rel(gathered_logits(chunks[0], batch, groups), ref_logits, f"{what} logits")
    for d in ddp:
        d.remove_hooks()
    groups.destroy()


def body(rank, world):
    references = {}
    for variant, dp, documents in [
        (variant, dp, False) for variant in ("gpt2", "llama") for dp in (1, 2)
    ] + [("gpt2", 1, True), ("llama", 1, True)]:
        model = GPTModel(make_cfg(variant, LAYERS, seq=SEQ, reset_position_ids=documents))
        init_chunk(model, SEED)
        losses = reference_step(model, M, dp, seq=SEQ, transform=packed if documents else None)
        references[(variant, dp, documents)] = (
            model,
            losses,
            {n: p.grad for n, p in model.named_parameters()},
        )
    for layout, members, variant, comm_types in CASES:
        for comm_type in comm_types:
            run_case(layout, members, variant, comm_type, references)
    for recompute in RECOMPUTE:
        run_case(Layout(cp=2), [0, 1], "llama", "p2p", references, recompute)
    for layout, members, variant, comm_types in DOC_CASES:
        for comm_type in comm_types:
            run_case(layout, members, variant, comm_type, references, documents=True)
    run_case(Layout(cp=2), [0, 1], "llama", "p2p", references, RECOMPUTE[1], documents=True)
    run_case(Layout(cp=2), [0, 1], "llama", "a2a", references, RECOMPUTE[0])
    # the fused (CPU flash) kernel once per document, the ids' host copy made once per batch
    run_case(Layout(cp=2), [0, 1], "llama", "p2p", references, documents=True, backend="flash")


def test_context_parallel_matches_single_process():
    spawn(body, world=4)


@pytest.mark.parametrize("cp", [2, 4])
def test_each_rank_holds_an_early_and_a_late_chunk(cp):
    seq = 4 * cp
    positions = [local_positions(seq, r, cp).tolist() for r in range(cp)]
    assert sorted(p for rank in positions for p in rank) == list(range(seq))
    c = seq // (2 * cp)
    assert positions[0][:c] == list(range(c)) and positions[0][c:] == list(range(seq - c, seq))
    batch = {"tokens": torch.arange(seq).expand(2, seq), "loss_mask": torch.ones(2, seq)}
    for r in range(cp):
        part = split_batch(batch, r, cp)
        assert part["tokens"][0].tolist() == positions[r]
        assert part["position_ids"][1].tolist() == positions[r]
