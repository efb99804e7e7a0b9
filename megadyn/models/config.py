"""The GPT model's configuration: one dataclass, one docstring per field.

Two families share the code: the GPT-2 block (learned positions, LayerNorm, GeLU, biases) and
the Llama block (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases).

    cfg = GPTConfig.gpt2(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100)
    cfg = GPTConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=4,
                          num_query_groups=2, vocab_size=100)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megadyn.core.tensor_parallel.fp8 import Fp8Recipe


@dataclass(frozen=True)
class GPTConfig:
    num_layers: int = 2
    """Transformer blocks (--num-layers)."""
    hidden_size: int = 64
    """Model width h (--hidden-size)."""
    num_attention_heads: int = 4
    """Query heads (--num-attention-heads)."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention (--num-query-groups); None = no grouping."""
    ffn_hidden_size: int | None = None
    """MLP width (--ffn-hidden-size); default 4h."""
    vocab_size: int = 128
    """Tokenizer vocabulary before padding."""
    make_vocab_size_divisible_by: int = 128
    """Vocabulary is padded to a multiple of this times tp (--make-vocab-size-divisible-by)."""
    max_position_embeddings: int = 128
    """Longest sequence (--max-position-embeddings); size of the learned position table."""
    position_embedding_type: str = "learned_absolute"
    """'learned_absolute' (GPT-2) or 'rope' (Llama) (--position-embedding-type)."""
    rotary_base: float = 10000.0
    """RoPE base frequency (--rotary-base)."""
    reset_position_ids: bool = False
    """Positions restart at 0 after each end-of-document token of a packed sample
    (--reset-position-ids): the data path resets each sample's position_ids, and learned
    position embeddings and rotary tables both follow them."""
    normalization: str = "LayerNorm"
    """'LayerNorm' or 'RMSNorm' (--normalization)."""
    norm_epsilon: float = 1e-5
    """Epsilon of the norms (--norm-epsilon)."""
    activation: str = "gelu"
    """'gelu' or 'swiglu' (--swiglu)."""
    openai_gelu: bool = False
    """GeLU by its tanh approximation, as OpenAI's GPT-2 (Hugging Face 'gelu_new') (--openai-gelu)."""
    add_bias_linear: bool = True
    """Biases in linear layers (--disable-bias-linear turns them off)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output layer instead of reusing the word embedding (--untie-embeddings-and-output-weights)."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP (--hidden-dropout)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (--attention-dropout)."""
    init_method_std: float = 0.02
    """Standard deviation of the normal initialization (--init-method-std)."""
    params_dtype: torch.dtype = torch.float32
    """Dtype of model weights: float32, bfloat16 (--bf16) or float16 (--fp16)."""
    gradient_accumulation_fusion: bool = True
    """Weight-gradient GEMMs of bf16/fp16 layers accumulate into the fp32 DDP `main_grad`
    directly (no bf16 gradient, no separate add); fp32 models are unaffected."""
    tp_comm_overlap: bool = False
    """Under sequence parallelism, split the GEMMs next to the all-gathers and the row-parallel
    reduce-scatter by sequence chunk, so each collective runs beside the GEMM of a chunk that
    does not need it (--tp-comm-overlap; meant for CUDA-graph steps, where the extra kernel
    launches cost no host time)."""
    tp_comm_overlap_transport: str = "nccl"
    """How --tp-comm-overlap moves data (--tp-comm-overlap-transport): 'nccl' (NCCL kernels) or
    'copy-engine' (GPU copy engines through torch's symmetric memory: no multiprocessors taken
    from the GEMMs beside them; CUDA with peer access between the tensor-parallel GPUs)."""
    fused_loss: bool | None = None
    """The vocab-parallel cross entropy through its Triton kernels (one pass each way); None:
    when the logits are on a GPU (the math is the same; eager on the CPU)."""
    cross_entropy_chunks: int = 1
    """The output layer and its cross entropy over this many chunks of tokens, never the
    whole logits at once (--cross-entropy-chunks; core/tensor_parallel/chunked_loss.py): the
    step's peak holds [tokens / N, V/tp] logits instead of [tokens, V/tp], for one more output
    GEMM in the backward. 1: the whole logits (the model returns them without labels)."""
    pointwise_fusion: bool = False
    """The transformer blocks' pointwise work through torch.compile's Triton kernels on CUDA
    (--pointwise-fusion): the norms, the residual add (with the hidden dropout) joined to the
    pre-MLP norm, SwiGLU and the rotary embeddings of queries and keys, each one compiled
    region (models/pointwise.py; eager on the CPU). The four switches below take one part
    back to the plain path; without this flag they change nothing."""
    norm_fusion: bool = True
    """Under --pointwise-fusion: RMSNorm / LayerNorm compiled (--no-norm-fusion: eager)."""
    bias_swiglu_fusion: bool = True
    """Under --pointwise-fusion: silu(gate) * up compiled, keeping only fc1's output for the
    backward (--no-bias-swiglu-fusion: eager)."""
    keep_fc2_input: bool = False
    """Under --pointwise-fusion with SwiGLU: fc2 keeps its input (SwiGLU's output; FP8
    tensorwise: its x^T in fp8) from the forward (--keep-fc2-input). By default it keeps
    nothing and the backward computes it again from fc1's output, which SwiGLU's backward keeps
    anyway: less memory (a [tokens, ffn/tp] tensor a layer), one more pointwise pass."""
    keep_norm_outputs: bool = False
    """Under --pointwise-fusion with the norm compiled: linear_qkv and linear_fc1 keep their
    inputs (the norms' outputs) from the forward (--keep-norm-outputs), and the pre-MLP norm
    joins the attention's residual add in one region. By default they keep nothing and the
    backward computes the norms again from their inputs, which the norms' backwards keep:
    less memory (two [tokens, hidden] tensors a layer; none under sequence parallelism, where
    the layers keep their gathered inputs anyway), two more pointwise passes."""
    apply_rope_fusion: bool = True
    """Under --pointwise-fusion: the rotary embeddings of queries and keys compiled
    (--no-rope-fusion: eager)."""
    bias_dropout_fusion: bool = True
    """Under --pointwise-fusion: the residual adds with their hidden dropout compiled, the
    attention's joined to the pre-MLP norm (--no-bias-dropout-fusion: eager)."""
    attention_backend: str = "auto"
    """Kernel of the attention (--attention-backend, Megatron's names): 'flash' (torch's flash
    kernel), 'fused' (cuDNN's fused attention), 'unfused' or 'local' (plain math), 'auto'
    (cuDNN first on Hopper GPUs, where it is the fastest kernel without TransformerEngine;
    torch's own order elsewhere)."""
    cp_comm_type: str = "p2p"
    """How attention reaches the keys and values of the other context-parallel ranks
    (--cp-comm-type, Megatron's names): 'p2p' (a ring of exchanges overlapped with blockwise
    attention), 'all_gather' (gather the whole sequence's keys and values once per layer) or
    'a2a' (all-to-all: each rank attends over the whole sequence with 1/cp of the heads; the
    key/value heads per tp rank must be a multiple of cp)."""
    cp_placement: str = "static"
    """Which tokens each context-parallel rank holds (--cp-placement): 'static' (two chunks per
    rank, an early and a late one) or 'dynamic' (per micro batch, blocks of --cp-block-size
    tokens placed so that every rank's attention work under the causal and document masks is
    equal; each rank receives only the key/value blocks it reads) or 'static_blocks' (the
    static split computed as dynamic's blocks: the comparison point of the balancing alone)."""
    cp_block_size: int = 1024
    """Tokens per block of --cp-placement dynamic (--cp-block-size); --seq-length must be a
    multiple of it times --context-parallel-size."""
    fp8_format: str | None = None
    """FP8 GEMMs in the transformer blocks' linear layers (--fp8-format): 'e4m3' (every
    operand float8_e4m3fn) or 'hybrid' (e4m3 forward, e5m2 gradients); None: the model's
    dtype. Embedding, output layer, norms and attention stay in the model's dtype."""
    fp8_recipe: str = "tensorwise"
    """Scaling of the FP8 operands (--fp8-recipe): 'tensorwise' (one dynamic scale per
    tensor) or 'rowwise' (one per row along the GEMM's contraction dimension)."""
    fp8_weight_cache: bool = True
    """Under --fp8-format: each weight quantized once per step and kept for its micro batches
    (--no-fp8-weight-cache: at every use, holding less through the step; a CUDA-graph step
    quantizes at every use anyway)."""
    apply_query_key_layer_scaling: bool = False
    """Unused by megadyn (scaled_dot_product_attention scales by 1/sqrt(d)); kept for flag parity."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden-size ({self.hidden_size}) must be divisible by "
                f"--num-attention-heads ({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.query_groups:
            raise ValueError(
                f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                f"--num-query-groups ({self.query_groups})"
            )
        for name, allowed in (
            ("position_embedding_type", ("learned_absolute", "rope")),
            ("normalization", ("LayerNorm", "RMSNorm")),
            ("activation", ("gelu", "swiglu")),
            ("attention_backend", ("auto", "flash", "fused", "unfused", "local")),
            ("tp_comm_overlap_transport", ("nccl", "copy-engine")),
            ("cp_comm_type", ("p2p", "all_gather", "a2a")),
            ("cp_placement", ("static", "dynamic", "static_blocks")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.cross_entropy_chunks < 1:
            raise ValueError(
                f"--cross-entropy-chunks must be >= 1, got {self.cross_entropy_chunks}"
            )
        if self.fp8_format is None and self.fp8_recipe != "tensorwise":
            raise ValueError("--fp8-recipe applies to --fp8-format: add it")
        _ = self.fp8  # its own checks, naming the flags

    @property
    def fp8(self) -> Fp8Recipe | None:
        """The linear layers' `fp8` recipe under --fp8-format, else None."""
        if self.fp8_format is None:
            return None
        return Fp8Recipe(self.fp8_format, self.fp8_recipe, self.fp8_weight_cache)

    @property
    def fp8_gemm_sizes(self) -> dict[str, int]:
        """The GEMM sizes split over tp, by the flags that set them (fp8.check_fp8_shapes)."""
        qkv = self.query_groups * (self.num_attention_heads // self.query_groups + 2)
        return {
            "--hidden-size": self.hidden_size,
            "--ffn-hidden-size": self.ffn_size,
            "the fused QKV size (--num-query-groups x --hidden-size / heads)": qkv * self.head_dim,
        }

    @property
    def comm_overlap(self) -> str | None:
        """The layers' `comm_overlap`: the transport under --tp-comm-overlap, else None."""
        return self.tp_comm_overlap_transport if self.tp_comm_overlap else None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary padded so that every tp rank holds an equal, aligned slice (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def with_(self, **changes) -> GPTConfig:
        return replace(self, **changes)

    @classmethod
    def gpt2(cls, **kw) -> GPTConfig:
        return cls(**kw)

    @classmethod
    def llama(cls, **kw) -> GPTConfig:
        base = dict(
            position_embedding_type="rope",
            normalization="RMSNorm",
            activation="swiglu",
            add_bias_linear=False,
            untie_embeddings_and_output_weights=True,
        )
        base.update(kw)
        return cls(**base)
