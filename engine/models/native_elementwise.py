"""RMSNorm, RoPE and silu(gate) * up on bfloat16 CPU tensors by C kernels of our own (`native_elementwise.c`).

On the CPU these are torch op chains over small tensors: RMSNorm is about a dozen aten calls (casts, pow, mean,
add, rsqrt, two products), RoPE five (a negation, a concatenation, two products, a sum), SwiGLU's activation
two. At one row a decode step of SmolLM2 spends more time dispatching them than multiplying its int4 weights'
worth of them; at 64 rows each pass over a float32 copy costs again. The kernels read their inputs once and
write the result once. `engine.util.native` builds them with the system C compiler at first use (cached); a
machine without AVX512-BF16 or a compiler keeps the torch ops, and a build or first-use check that fails warns
once and keeps them too.

Values (`native_elementwise.c`): RoPE is torch's bit for bit; RMSNorm's float32 statistics sum in another
order and silu's exponential is a polynomial, so those differ from torch's in the last place at most (two
units after the second product), as the fused CUDA kernels do (`engine.models.elementwise`). Every CPU
bfloat16 call they take goes through them, so the placements of one run agree with each other.

Each function returns None where its kernel does not apply (not the CPU, not bfloat16, a layout it does not
take, or the kernels unavailable); the caller then runs the torch ops.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.models.elementwise_torch import close_to_torch, rms_norm_torch, rope_torch
from engine.util.native import AVX512_BF16_CPU, AVX512_BF16_FLAGS, checked_library

SOURCE = Path(__file__).with_name("native_elementwise.c")

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "llmops_rms_norm_bf16": [_PTR, _I64, _I64, _I64, _PTR, _F32, _PTR, _INT],
    "llmops_rope_bf16": [_PTR] + [_I64] * 7 + [_PTR, _PTR, _I64, _I64, _PTR, _INT],
    "llmops_silu_mul_bf16": [_PTR, _PTR] + [_I64] * 4 + [_PTR, _INT],
}


def _bf16_cpu(*xs: torch.Tensor) -> bool:
    """Every x a bfloat16 CPU tensor with a contiguous last dim (a loop: this runs a few times per layer)."""
    for x in xs:
        if x.dtype != torch.bfloat16 or not x.is_cpu or x.stride(-1) != 1:
            return False
    return True


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    library: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """x [*lead, h], weight [h] -> [*lead, h] (contiguous), as `engine.models.elementwise.rms_norm`; None where
    the kernel does not apply. `library`: the kernels to call (default: this machine's, `_library`; the
    first-use check passes the ones it checks)."""
    h = x.shape[-1]
    if not (_bf16_cpu(x, weight) and weight.shape == (h,) and x.numel()):
        return None
    rows = x.reshape(-1, h)                                                            # [r, h]: a view when it can
    lib = library or _library()
    if lib is None or (rows.shape[0] > 1 and rows.stride(0) < h):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.llmops_rms_norm_bf16(rows.data_ptr(), rows.shape[0], h, rows.stride(0), weight.data_ptr(), eps,
                             out.data_ptr(), torch.get_num_threads())
    return out


def native_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int = 1,
                library: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """`engine.models.elementwise.rope_torch`'s rotation: x [b, n, s, hd] (head_dim 1) or [b, s, n, hd]
    (head_dim 2), cos/sin [b or 1, s, hd] -> the same layout (contiguous in [b, s, n, hd] order), bit for bit
    the torch ops; None where the kernel does not apply (hd not a multiple of 32, among others). `library`:
    `native_rms_norm`'s."""
    if not (x.dim() == 4 and head_dim in (1, 2) and _bf16_cpu(x, cos, sin) and x.shape[-1] % 32 == 0
            and cos.dim() == 3 and sin.shape == cos.shape and sin.stride() == cos.stride()
            and cos.shape[-1] == x.shape[-1] and cos.shape[0] in (1, x.shape[0]) and x.numel()):
        return None
    xs = x if head_dim == 2 else x.transpose(1, 2)                                     # [b, s, n, hd]
    b, s, n, hd = xs.shape
    if cos.shape[1] != s:
        return None
    lib = library or _library()
    if lib is None:
        return None
    out = torch.empty((b, s, n, hd), dtype=x.dtype)
    lib.llmops_rope_bf16(xs.data_ptr(), b, s, n, hd, *xs.stride()[:3], cos.data_ptr(), sin.data_ptr(),
                         cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), out.data_ptr(),
                         torch.get_num_threads())
    return out if head_dim == 2 else out.transpose(1, 2)


def native_silu_mul(gate: torch.Tensor, up: torch.Tensor, library: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """F.silu(gate) * up: gate, up [*lead, k] -> [*lead, k] (contiguous); None where the kernel does not
    apply. `library`: `native_rms_norm`'s."""
    k = gate.shape[-1]
    if not (_bf16_cpu(gate, up) and up.shape == gate.shape and gate.numel()):
        return None
    g, u = gate.reshape(-1, k), up.reshape(-1, k)                                      # [r, k]: views when they can
    lib = library or _library()
    if lib is None or (g.shape[0] > 1 and (g.stride(0) < k or u.stride(0) < k)):
        return None
    out = torch.empty(gate.shape, dtype=gate.dtype)
    lib.llmops_silu_mul_bf16(g.data_ptr(), u.data_ptr(), g.shape[0], k, g.stride(0), u.stride(0), out.data_ptr(),
                             torch.get_num_threads())
    return out


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    """The built kernels, checked once against the torch ops (`engine.util.native.checked_library`)."""
    return checked_library("native elementwise ops", SOURCE, AVX512_BF16_FLAGS, AVX512_BF16_CPU, _bind)


def _bind(library: ctypes.CDLL) -> None:
    """Declare the kernels' argument types and check them (`self_check`)."""
    for name, args in _SIGNATURES.items():
        fn = getattr(library, name)
        fn.argtypes, fn.restype = args, None
    self_check(library)


def self_check(library: ctypes.CDLL) -> None:
    """Each kernel against the torch ops on small strided inputs with a tail past the last 16 lanes: RoPE
    equal, RMSNorm and silu * up within two units in the last place; RuntimeError naming the kernel otherwise."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 2 * 300, generator=gen).to(torch.bfloat16)[..., :300]                # row stride 600
    w = (1 + 0.1 * torch.randn(300, generator=gen)).to(torch.bfloat16)
    q = torch.randn(2, 7, 5, 64, generator=gen).to(torch.bfloat16)[:, :, :3]                    # [2, 7, 3, 64]
    cos, sin = (torch.randn(2, 7, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    gate, up = torch.randn(4, 2 * 200, generator=gen).to(torch.bfloat16).chunk(2, dim=-1)       # [4, 200] each
    got = native_rms_norm(x, w, 1e-5, library)
    rope = native_rope(q, cos, sin, head_dim=2, library=library)
    act = native_silu_mul(gate, up, library)
    if not close_to_torch(got, rms_norm_torch(x, w, 1e-5), ulps=2):
        raise RuntimeError("the C rms_norm kernel differs from the torch ops")
    if not torch.equal(rope, rope_torch(q, cos, sin, head_dim=2)):
        raise RuntimeError("the C rope kernel differs from the torch ops")
    if not close_to_torch(act, F.silu(gate) * up, ulps=2):
        raise RuntimeError("the C silu_mul kernel differs from the torch ops")
