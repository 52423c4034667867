"""Helpers of the fused-kernel tests (they need Triton: callers importorskip it).

`compile_for_sm90`: compile a kernel for an H100/H200 (sm_90) without a GPU: Triton's front end, its passes
and the bundled ptxas run on the CPU, so errors the interpreter does not raise (non-constexpr globals, ops
without a GPU lowering, layouts the compiler refuses) fail a CPU test. `run_interpreted`: a script in a
subprocess under TRITON_INTERPRET=1 (the script imports `helpers.<module>` as the tests do).
`assert_self_check_passes`: a dispatcher's first-call check, run afresh on the current GPU, passes without the
fallback's warning.
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from typing import Any, Callable

import torch

from helpers.paths import REPO, TESTS


def compile_for_sm90(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], **options: Any) -> str:
    """PTX of `kernel` (a @triton.jit function) for the given argument types ("*fp16", "i32", "fp32", or
    "constexpr" for the names in `constexprs`) and compile options (num_warps, enable_fp_fusion...)."""
    import triton    # optional dependency: Triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def run_interpreted(code: str) -> None:
    """Run `code` with Triton's CPU interpreter in a fresh Python; assert it exits 0 (its stderr otherwise)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{REPO}{os.pathsep}{TESTS}")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


def assert_self_check_passes(ready: Callable[..., bool], *args: Any) -> None:
    """`ready` (an lru_cached `_triton_ready(device_index, *args)`) cleared and called on the current GPU:
    True, and no RuntimeWarning (the fallback's)."""
    ready.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert ready(torch.cuda.current_device(), *args)
