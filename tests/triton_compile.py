"""Compile a Triton kernel for an H100/H200 (sm_90) without a GPU: Triton's front end, its passes and the
bundled ptxas run on the CPU, so errors the interpreter does not raise (non-constexpr globals, ops without
a GPU lowering, layouts the compiler refuses) fail a CPU test. Needs Triton (callers importorskip it)."""
from __future__ import annotations

from typing import Any


def compile_for_sm90(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], **options: Any) -> str:
    """PTX of `kernel` (a @triton.jit function) for the given argument types ("*fp16", "i32", "fp32", or
    "constexpr" for the names in `constexprs`) and compile options (num_warps, enable_fp_fusion...)."""
    import triton    # optional dependency: Triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
