"""`native_argmax`: greedy choice over bfloat16 logits on the CPU by a C kernel of our own (`native_argmax.c`).

torch's `max(dim=-1)` reads a decode step's logits (64 rows of SmolLM2's 49152, say) more than once and in more
passes; the kernel reads each row once, 16 values at a time. `engine.util.native` builds it for this machine
at first use (system C compiler, cached, with the AVX512-BF16 flags of the engine's other kernels); a machine
without them or a compiler keeps torch's reduction.

Values: the index of each row's first maximum, exactly as torch gives it over the logits or their float32
conversion (a bfloat16 value widens exactly, so the order and the ties are the same; a row with NaN gives its
first NaN, as torch does). `native_argmax` returns None where the kernel does not apply (not a 2-D bfloat16 CPU
tensor with a contiguous last dim, an empty or too wide row, or the kernel unavailable); the caller then runs
torch's reduction.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Callable

import torch

from engine.util.native import checked_kernel

SOURCE = Path(__file__).with_name("native_argmax.c")
MAX_WIDTH = 2 ** 31 - 1          # the kernel counts a row's positions in 32-bit lanes

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def native_argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """logits [n, v] bfloat16 on the CPU (last dim contiguous) -> the index of each row's first maximum [n]
    int64, or None where the kernel does not apply (module docstring)."""
    if (logits.dim() != 2 or logits.dtype != torch.bfloat16 or not logits.is_cpu or logits.stride(1) != 1
            or not 0 < logits.shape[1] <= MAX_WIDTH):
        return None
    kernel = _kernel()
    if kernel is None:
        return None
    return _run(kernel, logits)


def _run(kernel: Callable[..., None], logits: torch.Tensor) -> torch.Tensor:
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    kernel(logits.data_ptr(), rows, n, logits.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


@functools.lru_cache(maxsize=None)
def _kernel() -> Callable[..., None] | None:
    """The built kernel, checked once against torch (`self_check`, `engine.util.native.checked_kernel`); None:
    torch runs."""
    return checked_kernel("native argmax", SOURCE, "llmops_argmax_bf16", [_PTR, _I64, _I64, _I64, _PTR, ctypes.c_int],
                          None, self_check)


def self_check(kernel: Callable[..., None]) -> None:
    """The kernel against torch's `max(dim=-1)` on strided rows with a tail past the last 16 lanes, ties
    (coarse values) and a row of -inf; RuntimeError otherwise."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 2 * 1000 + 3, generator=gen) * 4).round().to(torch.bfloat16)[:, :1003]  # [5, 1003]
    logits[3] = float("-inf")
    if not torch.equal(_run(kernel, logits), logits.max(dim=-1).indices):
        raise RuntimeError("the C argmax kernel differs from torch's max")
