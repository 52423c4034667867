"""Triton helpers shared by the fused kernels (imports Triton: only Triton modules import this one).

`round_to(x, OUT)`: float32 x to OUT (float16 / bfloat16 / float32) rounding to nearest even, as torch's
casts do; bfloat16 by hand on the bits, so Triton's CPU interpreter rounds the same way as the GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TL_DTYPES = {torch.float16: tl.float16, torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}


@triton.jit
def round_to(x, OUT: tl.constexpr):
    """float32 x -> OUT, round-to-nearest-even (NaN stays NaN, overflow gives inf)."""
    if OUT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000                # rtne to 8 mantissa bits
        y = bits.to(tl.float32, bitcast=True).to(tl.bfloat16)                      # exact: already bfloat16
    elif OUT == tl.float16:
        y = x.to(tl.float16, fp_downcast_rounding="rtne")
    else:
        y = x
    return y
