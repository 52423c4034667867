"""`native_decode_attention`: decode attention over a bfloat16 cache on the CPU by a C kernel of our own.

torch's SDPA on the CPU (its flash kernel) is built for long queries: a decode step's query is one position
(g positions once grouped-query heads are folded), and per (row, kv head) the kernel pays for GEMM calls and
per-thread buffers sized for blocks of at least 32 queries. At SmolLM2's shape on a 2-core AVX-512 machine
SDPA's attention over a 64-row batch costs a decode step more than its matmuls do.
`native_attention.c` reads each key and value once per (row, kv head) for the group's query heads, with
AVX512-BF16 dot products, an online softmax in float32 and no buffer beyond the stack
(benchmarks/kernels/cpu_attention_speed.py times both). `engine.util.native` builds it for this machine at
first use (system C compiler, cached); a machine without AVX512-BF16 or a compiler keeps SDPA.

Values: scores are exact products of bfloat16 pairs summed in float32; the probabilities are rounded to
bfloat16 before the product with the values, as torch's bfloat16 SDPA kernel rounds them; sums run in
another order than SDPA's, so outputs differ from it within bfloat16 rounding (the first-use check bounds
it). Every CPU decode over a dense bfloat16 cache takes this kernel where it applies, so the placements of one
run agree with each other.

`native_decode_attention` returns None where the kernel does not apply (not the CPU, not bfloat16, a head
width other than 32/64/128, more than 16 query heads per kv head, a layout it does not take, or the kernel
unavailable); the caller then runs SDPA.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from engine.util.native import checked_kernel

SOURCE = Path(__file__).with_name("native_attention.c")
HEAD_DIMS = (32, 64, 128)
MAX_GROUP = 16

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGS = [_I64] * 5 + [_PTR, _I64, _I64, _I64] * 3 + [_PTR, _I64, ctypes.c_float, _PTR, ctypes.c_int]


def native_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
                            scale: float) -> torch.Tensor | None:
    """q [b, nh, 1, hd], k/v [b, nkv, t, hd] bfloat16 CPU tensors (last dim contiguous; any other strides),
    key_valid [b, t] bool (last dim contiguous) -> [b, nh, 1, hd] bfloat16, or None where the kernel does
    not apply (module docstring)."""
    b, nh, s, hd = q.shape
    nkv, t = k.shape[1], k.shape[2]
    if (q.device.type != "cpu" or s != 1 or hd not in HEAD_DIMS or nh % nkv or nh // nkv > MAX_GROUP
            or not q.dtype == k.dtype == v.dtype == torch.bfloat16 or key_valid.dtype != torch.bool
            or k.stride(3) != 1 or v.stride(3) != 1 or v.shape[2] != t or key_valid.shape != (b, t)
            or key_valid.stride(1) != 1 or b == 0):
        return None
    kernel = _kernel()
    if kernel is None:
        return None
    return _run(kernel, q, k, v, key_valid, scale)


def _run(kernel: Callable[..., int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
         scale: float) -> torch.Tensor:
    """The kernel's call on tensors `native_decode_attention` accepted -> [b, nh, 1, hd]."""
    b, nh, _, hd = q.shape
    nkv, t = k.shape[1], k.shape[2]
    qg = q.reshape(b, nkv, nh // nkv, hd)                                                   # [b, nkv, g, hd]
    if qg.stride(3) != 1:
        qg = qg.contiguous()
    out = torch.empty((b, nh, 1, hd), dtype=q.dtype)                                        # = [b, nkv, g, hd]
    failed = kernel(b, nkv, nh // nkv, hd, t, qg.data_ptr(), *qg.stride()[:3], k.data_ptr(), *k.stride()[:3],
                    v.data_ptr(), *v.stride()[:3], key_valid.data_ptr(), key_valid.stride(0), scale,
                    out.data_ptr(), torch.get_num_threads())
    if failed:
        raise ValueError(f"native decode attention refused q {tuple(q.shape)}, k {tuple(k.shape)}")
    return out


@functools.lru_cache(maxsize=None)
def _kernel() -> Callable[..., int] | None:
    """The built kernel, checked once against SDPA (`self_check`, `engine.util.native.checked_kernel`); None:
    SDPA runs."""
    return checked_kernel("native decode attention", SOURCE, "llmops_decode_attention_bf16", _ARGS, ctypes.c_int,
                          self_check)


def self_check(kernel: Callable[..., int]) -> None:
    """The kernel against float32 SDPA on small strided cases (masked keys, each head width, groups of 1, 3
    and 16, a tail of keys past the last block of 16): within the error of bfloat16 SDPA itself plus one
    bfloat16 step at 1; RuntimeError naming the case otherwise."""
    gen = torch.Generator().manual_seed(0)
    for b, nkv, g, hd, t in ((3, 2, 3, 64, 37), (2, 1, 16, 128, 70), (4, 3, 1, 32, 130)):
        q = torch.randn(b, nkv * g, 1, hd, generator=gen).to(torch.bfloat16)
        k, v = (torch.randn(b, nkv, t + 9, hd, generator=gen).to(torch.bfloat16)[:, :, :t] for _ in range(2))
        valid = torch.rand(b, t, generator=gen) > 0.3
        valid[:, -1] = True
        got = _run(kernel, q, k, v, valid, hd ** -0.5).float()
        mask = valid[:, None, None, :]
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=hd ** -0.5,
                                              enable_gqa=True)
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hd ** -0.5, enable_gqa=True).float()
        err, bound = (got - want).abs().max().item(), (sdpa - want).abs().max().item() + 2 ** -8
        if not err <= bound:
            raise RuntimeError(f"native decode attention differs from SDPA at b={b} nkv={nkv} g={g} hd={hd} t={t}: "
                               f"max error {err:.3g} (bound {bound:.3g})")
