"""The fused (Triton) vocab-parallel cross entropy equals the eager one: loss and logit gradients.

The kernels run on CPU tensors under Triton's interpreter, which must be switched on before
triton is imported: every check runs in spawned processes started with TRITON_INTERPRET=1.
Vocabulary blocks smaller than the local vocabulary exercise the chunk loop and its masking.
"""

import importlib.util

import pytest
import torch
import torch.distributed as dist

from megadyn.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megadyn.testing import spawn

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (scripts/setup_env.sh installs it)",
)

S, B = 3, 2  # rows = s * b = 6
LOCAL_VOCABS = (37, 300)
BLOCKS = (16, 64, None)  # None: the default, one block covering the local vocabulary
TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-7),
    # one bf16 step: the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even)
    torch.bfloat16: dict(rtol=2**-7, atol=1e-7),
}


def losses_and_grads(logits, target, vocab_start, group, fused):
    logits = logits.detach().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, target, vocab_start, group, fused=fused)
    weight = torch.randn(loss.shape, generator=torch.Generator().manual_seed(3))
    (loss * weight).sum().backward()
    return loss.detach(), logits.grad


def case_inputs(world, rank, vocab, dtype, seed):
    """This rank's slice of global logits [s, b, world * vocab] and targets as labels.t()."""
    g = torch.Generator().manual_seed(seed)  # same global tensors on every rank
    full = (4 * torch.randn(B, S, world * vocab, generator=g)).to(dtype).transpose(0, 1)
    target = torch.randint(0, world * vocab, (B, S), generator=g).t()  # [s, b], non-contiguous
    local = full[..., rank * vocab : (rank + 1) * vocab]  # [s, b, V/tp], non-contiguous
    return local, target


def compare_body(rank, world):
    from megadyn.core.tensor_parallel import cross_entropy_kernels

    group = dist.group.WORLD if world > 1 else None
    for dtype in TOLERANCE:
        for vocab in LOCAL_VOCABS:
            for block in BLOCKS:
                logits, target = case_inputs(world, rank, vocab, dtype, seed=vocab)
                default = cross_entropy_kernels.MAX_BLOCK
                cross_entropy_kernels.MAX_BLOCK = block or default
                try:
                    loss, grad = losses_and_grads(logits, target, rank * vocab, group, True)
                finally:
                    cross_entropy_kernels.MAX_BLOCK = default
                ref_loss, ref_grad = losses_and_grads(logits, target, rank * vocab, group, False)
                what = f"tp={world} rank={rank} {dtype} V/tp={vocab} block={block}"
                assert grad.dtype == dtype and grad.shape == logits.shape, what
                torch.testing.assert_close(loss, ref_loss, **TOLERANCE[torch.float32], msg=what)
                torch.testing.assert_close(grad, ref_grad, **TOLERANCE[dtype], msg=what)


def outside_targets_body(rank, world):
    """Without communication, a vocab_start that leaves some targets on other ranks."""
    from megadyn.core.tensor_parallel import cross_entropy_kernels

    logits, target = case_inputs(3, 1, 37, torch.float32, seed=5)  # targets in [0, 111)
    vocab_start = 37
    assert ((target < vocab_start) | (target >= 2 * vocab_start)).any()
    stats = cross_entropy_kernels.row_statistics(logits, target, vocab_start, block=16)
    local_max, local_sum, target_logit = stats
    wide = logits.float()
    torch.testing.assert_close(local_max, wide.max(-1).values)
    torch.testing.assert_close(local_sum, (wide - local_max[..., None]).exp().sum(-1))
    inside = (target >= vocab_start) & (target < 2 * vocab_start)
    local = (target - vocab_start).clamp(0, 36)
    expected = wide.gather(-1, local[..., None])[..., 0].masked_fill(~inside, 0.0)
    torch.testing.assert_close(target_logit, expected, rtol=0, atol=0)
    (loss, grad), (ref_loss, ref_grad) = (
        losses_and_grads(logits, target, vocab_start, None, fused) for fused in (True, False)
    )
    torch.testing.assert_close(grad, ref_grad, **TOLERANCE[torch.float32])
    # alone, a rank whose target is elsewhere adds T = 0 to the raw logits (fused) or to the
    # shifted ones (eager); summed over the whole vocabulary's ranks, both give the same loss
    shift = torch.where(inside, 0.0, local_max)
    torch.testing.assert_close(loss, ref_loss + shift, **TOLERANCE[torch.float32])
    overwritten_logits(logits, target, vocab_start)


def overwritten_logits(logits, target, vocab_start):
    """Logits an operation produced take their gradient in place (no second [s*b, V] tensor);
    a leaf's do not; a second backward through the graph is refused."""
    leaf = logits.detach().requires_grad_()
    produced = (leaf * 1.0).contiguous()
    seen = []
    produced.register_hook(seen.append)
    loss = vocab_parallel_cross_entropy(produced, target, vocab_start, None, fused=True)
    loss.sum().backward(retain_graph=True)
    assert seen[0].data_ptr() == produced.data_ptr()
    eager = logits.detach().requires_grad_()
    vocab_parallel_cross_entropy(eager, target, vocab_start, None, fused=False).sum().backward()
    torch.testing.assert_close(leaf.grad, eager.grad, **TOLERANCE[torch.float32])
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.sum().backward()
    kept = logits.detach().clone().requires_grad_()
    vocab_parallel_cross_entropy(kept, target, vocab_start, None, fused=True).sum().backward()
    assert torch.equal(kept.detach(), logits) and kept.grad.data_ptr() != kept.data_ptr()


def cpu_refused_body(rank, world):
    logits, target = case_inputs(1, 0, 37, torch.float32, seed=0)
    with pytest.raises(ValueError, match="CUDA tensors"):
        vocab_parallel_cross_entropy(logits, target, 0, None, fused=True)


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the spawned processes


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_matches_eager(interpreter, tp):
    spawn(compare_body, world=tp)


def test_targets_outside_the_local_vocabulary(interpreter):
    spawn(outside_targets_body, world=1)


def test_fused_refuses_cpu_logits_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spawn(cpu_refused_body, world=1)
