"""Which floating dtype multiplies fastest on this CPU, measured once per process.

bf16 is not always faster on a CPU: it depends on the ISA (AVX512-BF16/AMX) and on the kernels the torch
build dispatches to. On the 2-core development machine (torch 2.13 CPU wheel) a bf16 GEMM ran ~3x slower than
fp32; on the lent H200's 16-core host bf16 was ~2.3x faster. So "auto" asks the machine.
"""
from __future__ import annotations

import functools
import time

import torch

_SHAPE = (256, 576, 1536)   # a decode-sized GEMM (m, k, n): rows x hidden -> MLP width


def _gemm_seconds(dtype: torch.dtype, repeats: int = 3) -> float:
    m, k, n = _SHAPE
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dtype)  # [m, k]
    b = torch.randn(n, k, generator=gen).to(dtype)  # [n, k]
    torch.nn.functional.linear(a, b)  # warm-up: kernel selection, packing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(a, b)  # [m, n]
        best = min(best, time.perf_counter() - start)
    return best


@functools.lru_cache(maxsize=1)
def fastest_cpu_dtype() -> torch.dtype:
    """bfloat16 when a bf16 GEMM beats float32 on this CPU by 10% or more, else float32 (~10 ms, once)."""
    return torch.bfloat16 if _gemm_seconds(torch.bfloat16) < 0.9 * _gemm_seconds(torch.float32) else torch.float32
