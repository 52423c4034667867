"""The fused quantize's parity rule against the torch ops (`quantize_torch`): the same layout, min/scale within
one ulp, codes off by at most one in under 0.1% of the elements, dequantized values within one quantization step.
Imported by the tests and by the scripts they run under Triton's interpreter."""
from __future__ import annotations

import torch

from engine.quant import QuantConfig, dequantize
from engine.quant.group import quantize_mismatch, quantize_torch
from engine.quant.qtensor import QTensor


def random_input(shape, dtype, seed=0) -> torch.Tensor:
    """Values ~ N(0.3, 2^2) of `shape` in `dtype`, seeded."""
    torch.manual_seed(seed)
    return (torch.randn(shape) * 2 + 0.3).to(dtype)


def check_against_torch(got: QTensor, x: torch.Tensor, config: QuantConfig) -> None:
    """`got` (the fused quantize of x) holds what `quantize_torch` gives, within the rule above."""
    want = quantize_torch(x.cpu(), config)
    assert got.shape == x.shape and got.dtype == x.dtype and got.config == config
    problem = quantize_mismatch(got, want)
    assert problem is None, f"{x.dtype} {tuple(x.shape)} {config}: {problem}"
    # in the stored basis (rotated groups as stored; H is orthonormal, so a group's L2 error is the same
    # after un-rotating): within one step (a code off by one), plus the min/scale differences, plus the
    # rounding of the dequantized values to x's dtype
    a = dequantize(got, unrotate=False).cpu().float()                              # [*lead, g*gs]
    b = dequantize(want, unrotate=False).float()

    def per_element(t: torch.Tensor) -> torch.Tensor:                              # [*lead, g, 1] -> [*lead, g*gs]
        return t.float().expand(*t.shape[:-1], config.group_size).flatten(-2)

    d_mn, d_scale = (got.mn.cpu().float() - want.mn.float()).abs(), (got.scale.cpu().float() - want.scale.float()).abs()
    bound = (per_element(want.scale) + per_element(d_mn) + config.levels * per_element(d_scale)
             + 2 * torch.finfo(x.dtype).eps * b.abs())
    assert bool(((a - b).abs() <= bound * 1.001 + 1e-30).all())
