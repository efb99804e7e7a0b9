"""Megatron-Core's GPT with its local (pure PyTorch) layer spec on a Llama-style model: the
Megatron-Core run of scripts/gpu/titan_compare.sh's rows (issue 40). No Transformer Engine, no
apex: RMSNorm is torch.nn.RMSNorm (Megatron-Core's WrappedTorchNorm), SwiGLU its fused
bias_swiglu (torch.compile'd by Megatron-Core's jit_fuser), RoPE unfused, core attention torch's
scaled_dot_product_attention with GQA inside the kernel and cuDNN's kernel first on Hopper, as
tools/bench_gpt.py picks it (--attn sdpa; `local` keeps Megatron-Core's unfused attention), dp
ranks through its DistributedDataParallel and distributed optimizer (gradient reduce-scatter and
parameter all-gather overlapped with compute, as Megatron-LM's --overlap-grad-reduce
--overlap-param-gather).

    torchrun --nproc-per-node 2 scripts/gpu/mcore_llama_bench.py \\
        $(python -m megadyn.bench titan_compare mcore-args 2gpu_bf16) --iters 8 --warmup 3
    python3 scripts/gpu/mcore_llama_bench.py --device cpu --layers 2 --hidden 64 ...  # CPU check

The model flags are tools/bench_gpt.py's (Megatron-LM's names), so one list serves both. One
line `BENCH_JSON {...}`: tokens/s/GPU, TFLOP/s/GPU and MFU by megadyn/models/flops.py's count
(6 x the matmul weights a token, GQA and SwiGLU counted, + 12 x layers x hidden x seq; the
reference script's PTD-P formula for the GPT-2 block), peak memory allocated and reserved (the
maximum over ranks). Megatron-Core has no FP8 without Transformer Engine (its fp8 context is a
no-op then), so this script refuses --fp8-format.

--device cpu (one process, gloo) builds the same model on the CPU and runs the forward and
backward of each step's micro batches without the DDP wrapper and the optimizer (both CUDA-only
in Megatron-Core): a check that the spec builds the architecture, printing its parameter count.
"""

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--group-query-attention", action="store_true")
    p.add_argument("--num-query-groups", type=int, default=None)
    p.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--gbs", type=int, default=8)
    p.add_argument("--swiglu", action="store_true")
    p.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    p.add_argument("--norm-epsilon", type=float, default=1e-5)
    p.add_argument(
        "--position-embedding-type",
        choices=["learned_absolute", "rope"],
        default="learned_absolute",
    )
    p.add_argument("--rotary-base", type=int, default=10000)
    p.add_argument("--disable-bias-linear", action="store_true")
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    p.add_argument("--attn", choices=["sdpa", "local"], default="sdpa")
    p.add_argument(
        "--attention-backend",
        choices=["auto", "flash", "fused"],
        default="auto",
        help="SDPA's kernel under --attn sdpa (auto: cuDNN first on Hopper, as tools/bench_gpt.py)",
    )
    p.add_argument("--no-overlap-grad-reduce", action="store_true")
    p.add_argument("--no-overlap-param-gather", action="store_true")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--fp8-format", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.fp8_format:
        p.error("Megatron-Core's FP8 needs Transformer Engine (n/a in this local-spec benchmark)")
    if a.num_query_groups is None or not a.group_query_attention:
        a.num_query_groups = a.heads
    a.ffn_hidden_size = a.ffn_hidden_size or 4 * a.hidden
    return a


def megadyn_config(a):
    """The same model as megadyn's GPTConfig (its vocabulary padding and FLOP count apply)."""
    from megadyn.models.config import GPTConfig

    return GPTConfig(
        num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
        num_query_groups=a.num_query_groups, ffn_hidden_size=a.ffn_hidden_size,
        vocab_size=a.vocab, make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
        activation="swiglu" if a.swiglu else "gelu",
    )  # fmt: skip


def padded_vocab(a, tp: int = 1) -> int:
    """Megatron-LM's padding of the vocabulary (--make-vocab-size-divisible-by x tp)."""
    return megadyn_config(a).padded_vocab_size(tp)


def flops_per_iteration(a) -> int:
    """Forward + backward matmul FLOPs of one step of a.gbs sequences: megadyn/models/flops.py's
    count, so the MFU columns of every framework compare."""
    from megadyn.models.flops import model_flops_per_iteration

    return model_flops_per_iteration(megadyn_config(a), a.gbs, a.seq)


KERNELS = {  # --attention-backend: SDPA's kernels in order ("auto": cuDNN first on Hopper)
    "flash": ["FLASH_ATTENTION"],
    "fused": ["CUDNN_ATTENTION"],
    "auto": ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"],
}


def attention_kernels(backend: str, q):
    """SDPA's kernel choice as tools/bench_gpt.py makes it (megadyn/models/attention.py):
    a named kernel alone; 'auto' puts cuDNN's fused attention first on compute capability 9.x,
    which is also what Transformer Engine's attention runs there."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [getattr(SDPBackend, k) for k in KERNELS[backend]]
    if backend != "auto":
        return sdpa_kernel(order)
    if q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9:
        return sdpa_kernel(order, set_priority=True)
    return contextlib.nullcontext()


def sdpa_attention_class(backend: str = "auto"):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPAAttention(DotProductAttention):
        """Core attention through torch's fused scaled_dot_product_attention, causal; GQA's
        key/value heads are shared inside the kernel (enable_gqa), as megadyn calls it."""

        def forward(
            self,
            query,
            key,
            value,
            attention_mask=None,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
            **kwargs,
        ):
            # [s, b, heads, d] -> [b, heads, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            gqa = k.shape[1] != q.shape[1]
            with attention_kernels(backend, q):
                out = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa
                )
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    return SDPAAttention


def transformer_config(a, cuda: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        num_query_groups=a.num_query_groups,
        ffn_hidden_size=a.ffn_hidden_size,
        normalization=a.normalization,
        layernorm_epsilon=a.norm_epsilon,
        gated_linear_unit=a.swiglu,
        activation_func=F.silu if a.swiglu else F.gelu,
        add_bias_linear=not a.disable_bias_linear,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,  # apex's fused weight-gradient kernel
        # Megatron-LM's default: the jit-fused (bias-)SwiGLU; GeLU's fusion needs a bias
        bias_activation_fusion=a.swiglu or not a.disable_bias_linear,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,  # Transformer Engine's kernel
        use_cpu_initialization=not cuda,
    )


def build_model(a, cfg):
    """GPTModel with the local spec; the spec's RMSNorm is torch.nn.RMSNorm (WrappedTorchNorm)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization=a.normalization)
    if a.attn == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = sdpa_attention_class(
            a.attention_backend
        )
    return GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab(a),
        max_sequence_length=a.seq,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
        position_embedding_type=a.position_embedding_type,
        rotary_base=a.rotary_base,
    )


def architecture(model) -> dict:
    """What the built model is made of (read back from its modules, for the CPU check)."""
    names = dict(model.named_modules())
    layer = model.decoder.layers[0]
    return dict(
        norm=type(layer.input_layernorm).__name__,
        final_norm=type(model.decoder.final_layernorm).__name__,
        qkv=list(layer.self_attention.linear_qkv.weight.shape),
        fc1=list(layer.mlp.linear_fc1.weight.shape),
        biases=sum(1 for n, _ in model.named_parameters() if n.endswith(".bias")),
        rope="rotary_pos_emb" in names,
        untied=model.output_layer.weight is not None
        and model.output_layer.weight is not model.embedding.word_embeddings.weight,
        core_attention=type(layer.self_attention.core_attention).__name__,
    )


def init_single_process():
    """Environment for one process without torchrun (the CPU check)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def main(argv=None):
    a = parse(argv)
    cuda = a.device == "cuda"
    init_single_process()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    if cuda:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    else:
        torch.manual_seed(1234)
        # Megatron-Core's RoPE moves its frequencies to torch.cuda.current_device(): the CPU here
        torch.cuda.current_device = lambda: "cpu"
    dp = ps.get_data_parallel_world_size()
    world = dist.get_world_size()
    if a.gbs % (a.mbs * dp):
        sys.exit(f"--gbs {a.gbs} is not a multiple of --mbs {a.mbs} x dp {dp}")
    num_micro = a.gbs // (a.mbs * dp)
    cfg = transformer_config(a, cuda)
    model = build_model(a, cfg)
    arch = architecture(model)
    params = sum(p.numel() for p in model.parameters())
    device = torch.device("cuda") if cuda else torch.device("cpu")
    model = Float16Module(cfg, model.to(device))  # bf16 everywhere, as Megatron-LM wraps it
    g = torch.Generator(device=device).manual_seed(dist.get_rank() + 7)
    pos = torch.arange(a.seq, device=device).unsqueeze(0).expand(a.mbs, -1)

    def batches():
        while True:
            tok = torch.randint(0, a.vocab, (a.mbs, a.seq + 1), device=device, generator=g)
            yield tok[:, :-1].contiguous(), tok[:, 1:].contiguous()

    if cuda:
        step, chunk = cuda_step(a, cfg, model, batches(), pos, num_micro)
    else:
        step, chunk = cpu_step(model, batches(), pos, num_micro), None

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()  # after the build, as tools/bench_gpt.py
    times = []
    for _ in range(a.warmup + a.iters):
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
    warm, timed = times[: a.warmup], times[a.warmup :] or times
    med = sorted(timed)[len(timed) // 2]  # the middle step as tools/bench_gpt.py takes it
    flops = flops_per_iteration(a)
    tflops = flops / med / world / 1e12
    mem = torch.tensor(
        [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
        if cuda
        else [0.0, 0.0],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    res = dict(
        framework="megatron-core",
        version=_version(),
        spec="local",
        attn=a.attn,
        attention_backend=a.attention_backend if a.attn == "sdpa" else None,
        device=a.device,
        dp=dp,
        distributed_optimizer=cuda,
        overlap_param_gather=cuda and dp > 1 and not a.no_overlap_param_gather,
        fp8=None,
        layers=a.layers,
        hidden=a.hidden,
        heads=a.heads,
        query_groups=a.num_query_groups,
        ffn=a.ffn_hidden_size,
        vocab=padded_vocab(a),
        seq=a.seq,
        mbs=a.mbs,
        gbs=a.gbs,
        params=params,
        arch=arch,
        loss=round(float(loss), 4),
        flops_per_iter=flops,
        iter_s=round(med, 4),
        iters_s=[round(t, 3) for t in timed],
        warmup_iter_s=[round(t, 3) for t in warm],
        tokens_per_s_per_gpu=round(a.gbs * a.seq / med / world, 1),
        tflops_per_gpu=round(tflops, 1),
        mfu=round(tflops / a.peak_tflops, 4),
        peak_mem_gib=round(mem[0].item() / 2**30, 2),
        peak_reserved_gib=round(mem[1].item() / 2**30, 2),
    )
    if dist.get_rank() == 0:
        print("BENCH_JSON " + json.dumps(res), flush=True)
    dist.barrier()
    del chunk
    dist.destroy_process_group()


def _loss(out):
    loss = out.float().mean()  # GPTModel returns the per-token cross entropy given labels
    return loss, {"lm loss": loss.detach()}


def cuda_step(a, cfg, model, it, pos, num_micro):
    """One training step through Megatron-Core's schedule, DDP and distributed optimizer."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp = dist.get_world_size()
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=not a.no_overlap_grad_reduce,
        overlap_param_gather=dp > 1 and not a.no_overlap_param_gather,
        use_distributed_optimizer=True,
    )
    chunk = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, use_distributed_optimizer=True),
        [chunk],
    )
    cfg.no_sync_func = chunk.no_sync
    cfg.finalize_model_grads_func = finalize_model_grads
    fb = get_forward_backward_func()

    def forward_step(data, m):
        x, y = next(data)
        return m(x, pos, None, labels=y), _loss

    def step():
        chunk.zero_grad_buffer()
        opt.zero_grad()  # under overlap_param_gather, the forward's pre-hooks gather the params
        losses = fb(
            forward_step_func=forward_step,
            data_iterator=it,
            model=chunk,
            num_microbatches=num_micro,
            seq_length=a.seq,
            micro_batch_size=a.mbs,
            forward_only=False,
        )
        opt.step()
        return losses[-1]["lm loss"] if losses else float("nan")

    return step, chunk


def cpu_step(model, it, pos, num_micro):
    """Forward and backward of each micro batch, no optimizer (the CPU check)."""

    def step():
        model.zero_grad(set_to_none=True)
        for _ in range(num_micro):
            x, y = next(it)
            loss, _ = _loss(model(x, pos, None, labels=y))
            (loss / num_micro).backward()
        return loss.detach()

    return step


def _version():
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:
        return "?"


if __name__ == "__main__":
    main()
