"""The torch references of the decoder layers' elementwise work (`engine.models.elementwise`): RMSNorm, RoPE and
silu(gate) * up exactly as Hugging Face computes them, and the unit-in-the-last-place comparison the fused
kernels (Triton on CUDA, C on the CPU) are checked with against them."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` by torch ops (any device; the reference the kernel is checked against). On the CPU the
    float32 statistics and scaling are aten's `rms_norm` on x as it is (one call, where the explicit formula
    xf * rsqrt(mean(xf^2) + eps) takes six): it upcasts a half-precision x to float32 and rounds the normalized
    row back to x's dtype itself, the same casts as the formula's (the same bits:
    tests/engine/test_cpu_decode_ops.py); the weight multiplies after that rounding, as Hugging Face does."""
    dtype = x.dtype
    if not x.is_cuda:
        return weight * torch.rms_norm(x, (x.shape[-1],), None, eps)
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int = 1) -> torch.Tensor:
    """`rope` by torch ops (any device; the reference): cos/sin broadcast over the heads, which are x's dim
    `head_dim` (1: [b, n, s, hd]; 2: [b, s, n, hd], the layout q and k leave one projection in, so both
    rotate in one pass)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1).mul_(sin.unsqueeze(head_dim))
    return (x * cos.unsqueeze(head_dim)).add_(rotated)   # x cos + rotated sin, two temporaries alive, not three


def silu_mul_torch(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None,
                   scale: torch.Tensor | None = None) -> torch.Tensor:
    """`silu_mul` by torch ops (any device; the reference); with out=gate in place, no third buffer."""
    y = F.silu(gate, inplace=True).mul_(up) if out is gate else torch.mul(F.silu(gate), up, out=out)
    return y if scale is None else y.mul_(scale.unsqueeze(-1))


def close_to_torch(got: torch.Tensor, want: torch.Tensor, ulps: int = 1) -> bool:
    """Same shape and dtype, and float16/bfloat16 elements within `ulps` units in the last place of `want`
    (the spacing at its magnitude); float32 within 2^-20 relative plus 2^-20 of want's largest magnitude
    (Triton's exp/rsqrt are approximations)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    a, b = got.double(), want.double()
    if want.dtype == torch.float32:
        return bool(torch.allclose(a, b, rtol=2 ** -20, atol=2 ** -20 * float(b.abs().max()) if b.numel() else 0.0))
    return bool(((a - b).abs() <= ulps * ulp_spacing(b, want.dtype)).all())


def ulp_spacing(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype`'s values at each of `values`' magnitudes (one unit in the last place), in
    values' own (wider) dtype; subnormal magnitudes count as the smallest normal."""
    finfo = torch.finfo(dtype)
    return torch.exp2(torch.floor(torch.log2(values.abs().clamp_min(finfo.tiny)))) * finfo.eps

