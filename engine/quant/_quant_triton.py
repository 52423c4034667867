"""The fused Triton kernel behind `engine.quant.group.quantize` on CUDA (imports Triton: load lazily).

One program quantizes BLOCK_G consecutive groups (the groups of all rows, numbered row-major): it loads
each group's elements once (zero beyond the last dim: the padding to whole groups), rotates them by the
normalized Hadamard matrix when the config says so, takes min/max, rounds min and scale to their stored
dtype, computes the codes and writes the packed bytes (element 2i in the low nibble) and min/scale. The
outputs are contiguous, in exactly `quantize`'s layout.

Arithmetic follows the torch path op for op in float32 (no FMA contraction: `enable_fp_fusion=False`):
scale = (max - min) / levels and 1 / scale with IEEE division (`div_rn`), code = clamp(rint((x - min) *
(1 / scale)), 0, levels) with rint as (y + 1.5 * 2^23) - 1.5 * 2^23 (round-half-even for |y| < 2^22;
larger |y| is clamped anyway; Triton's interpreter has no libdevice). The rotation is one `tl.dot` of the
[BLOCK_G, gs] tile with H built in registers (H[i, k] = (-1)^popcount(i & k) / sqrt(gs), the same float32
entries as `group.hadamard`), at input_precision="ieee": plain float32 FMAs like the torch path's float32
GEMM (no TF32), only the summation order differs, so a code may differ where a value sits within a
rounding of a code boundary. A butterfly (FWHT) would need register permutes per stage; at gs <= 128 the
dot is a few percent of the kernel's memory time, so the simpler dot it is.

Lead dims: any strides (the last dim contiguous), up to 4 lead dims after merging the ones that fold; other
layouts are made contiguous first.
"""
from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from engine.quant.config import QuantConfig
from engine.quant.qtensor import QTensor, scale_dtype
from engine.util._triton_cast import TL_DTYPES, round_to

_ELEMENTS = 1024        # elements per program (BLOCK_G = _ELEMENTS // gs groups, at least 16 for tl.dot)
_WARPS = 8              # sm_90, ptxas: 96-100 registers per thread at gs 32/64, no spills (4 warps: 150-255)
_MAX_LEAD = 4
_RINT = tl.constexpr(12582912.0)      # 1.5 * 2^23


@triton.jit
def _quantize_kernel(x_ptr, data_ptr, mn_ptr, scale_ptr, n_groups, groups, d,
                     size1, size2, size3, stride0, stride1, stride2, stride3, inv_sqrt,
                     GS: tl.constexpr, LEVELS: tl.constexpr, ROTATE: tl.constexpr, SCALE: tl.constexpr,
                     BLOCK_G: tl.constexpr):
    n = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)      # [BG] group number
    valid = n < n_groups
    row, grp = n // groups, n % groups
    i3 = row % size3
    rest = row // size3
    i2 = rest % size2
    rest = rest // size2
    i1 = rest % size1
    i0 = rest // size1
    start = i0 * stride0 + i1 * stride1 + i2 * stride2 + i3 * stride3 + grp * GS   # [BG] first element
    j = tl.arange(0, GS)
    mask = valid[:, None] & ((grp * GS)[:, None] + j[None, :] < d)
    xf = tl.load(x_ptr + start[:, None] + j[None, :], mask=mask, other=0.0).to(tl.float32)  # [BG, GS]
    if ROTATE:
        bits = j[:, None] & j[None, :]                                          # [GS, GS]
        bits = bits ^ (bits >> 4)
        bits = bits ^ (bits >> 2)
        bits = bits ^ (bits >> 1)                                               # bit 0: parity (GS <= 128)
        h = tl.where((bits & 1) == 1, -inv_sqrt, inv_sqrt)                      # [GS, GS] float32
        xf = tl.dot(xf, h, input_precision="ieee")                             # [BG, GS] rotated basis
    mn = tl.min(xf, axis=1)                                                     # [BG]
    mx = tl.max(xf, axis=1)
    scale = tl.math.div_rn(mx - mn, LEVELS * 1.0)
    mn_s = round_to(mn, SCALE)                                                  # stored precision
    scale_s = round_to(scale, SCALE)
    mn_f, sc_f = mn_s.to(tl.float32), scale_s.to(tl.float32)
    inv = tl.where(sc_f > 0, tl.math.div_rn(1.0, tl.where(sc_f > 0, sc_f, 1.0)), 0.0)
    y = (xf - mn_f[:, None]) * inv[:, None]                                     # [BG, GS]
    y = (y + _RINT) - _RINT                                                     # rint, half to even
    codes = tl.minimum(tl.maximum(y, 0.0), LEVELS * 1.0).to(tl.uint8)
    even, odd = tl.split(tl.reshape(codes, (BLOCK_G, GS // 2, 2)))              # [BG, GS/2] x 2
    k = tl.arange(0, GS // 2)
    tl.store(data_ptr + n[:, None] * (GS // 2) + k[None, :], even | (odd << 4), mask=valid[:, None])
    tl.store(mn_ptr + n, mn_s, mask=valid)
    tl.store(scale_ptr + n, scale_s, mask=valid)


def _lead_layout(x: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """(sizes, strides) of x's lead dims, size-1 dims dropped, foldable neighbours merged, left-padded to
    `_MAX_LEAD` dims; None when more remain."""
    merged: list[list[int]] = []
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = [merged[-1][0] * size, stride]
        else:
            merged.append([size, stride])
    if len(merged) > _MAX_LEAD:
        return None
    merged = [[1, 0]] * (_MAX_LEAD - len(merged)) + merged
    return [s for s, _ in merged], [st for _, st in merged]


def launch_block(group_size: int) -> int:
    """BLOCK_G, the groups one program quantizes."""
    return max(_ELEMENTS // group_size, 16)


def quantize_triton(x: torch.Tensor, config: QuantConfig) -> QTensor:
    """`quantize(x, config)` by one kernel launch on the current CUDA stream (asynchronous; on the CPU under
    TRITON_INTERPRET=1). x: float16/bfloat16/float32 [*lead, d]; config.group_size one of
    `group.FUSED_GROUP_SIZES` (checked by the caller)."""
    *lead, d = x.shape
    gs = config.group_size
    groups = -(-d // gs)
    if (x.stride(-1) != 1 and d > 1) or _lead_layout(x) is None:
        x = x.contiguous()
    sizes, strides = _lead_layout(x)
    sdt = scale_dtype(x.dtype)
    data = torch.empty((*lead, groups, gs // 2), dtype=torch.uint8, device=x.device)
    mn = torch.empty((*lead, groups, 1), dtype=sdt, device=x.device)
    scale = torch.empty((*lead, groups, 1), dtype=sdt, device=x.device)
    n_groups = math.prod(lead) * groups
    if n_groups:
        block_g = launch_block(gs)
        on_device = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()  # cpu: interpreter
        with on_device:
            _quantize_kernel[(triton.cdiv(n_groups, block_g),)](
                x, data, mn, scale, n_groups, groups, d, sizes[1], sizes[2], sizes[3], *strides,
                1.0 / math.sqrt(gs), GS=gs, LEVELS=config.levels, ROTATE=config.rotate, SCALE=TL_DTYPES[sdt],
                BLOCK_G=block_g, num_warps=_WARPS, enable_fp_fusion=False)
    return QTensor(data, mn, scale, torch.Size(x.shape), config, x.dtype)
