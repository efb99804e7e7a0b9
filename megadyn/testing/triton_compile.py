"""Compile a Triton kernel for Hopper (sm_90) on a machine without a GPU, for CPU tests.

    ptx = hopper_ptx(kernel, {"x_ptr": "*bf16", "n": "i32"}, {"BLOCK": 256}, num_warps=8)

Triton's interpreter (how the CPU tests run kernels) accepts code the compiler refuses, such as
a Python global read inside @triton.jit; compiling catches that, and the PTX shows whether
accesses are 128-bit wide (`ld.global.v4`). Every pointer and integer argument is assumed
16-aligned, as Triton assumes for the tensors and sizes it sees at launch.
"""

from __future__ import annotations


def hopper_ptx(kernel, signature: dict[str, str], constexprs: dict, num_warps: int) -> str:
    """PTX of `kernel` for sm_90; `signature` names each runtime argument's Triton type in the
    kernel's order, `constexprs` the values of its tl.constexpr arguments."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    types = {name: types[name] for name in kernel.arg_names}
    aligned = [i for i, t in enumerate(types.values()) if t[0] == "*" or t in ("i32", "i64")]
    source = ASTSource(
        fn=kernel,
        signature=types,
        constexprs=constexprs,
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )
    return compiled.asm["ptx"]
