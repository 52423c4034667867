"""The fused Triton kernels behind `engine.models.elementwise` on CUDA (imports Triton: load lazily).

  - `rms_norm_triton`: one pass over x [R, h] (rows with a row stride, the last dim contiguous): float32
    sum of squares, mean, rsqrt, the normalized row rounded to x's dtype, times the weight in float32 and
    rounded again, as the torch ops do; ROWS rows per program when h is small.
  - `silu_mul_triton`: silu(gate) * up over [R, n] views (gate/up may be the two halves of one projection):
    silu in float32 rounded to the input dtype, then the product in float32 rounded again, as torch's
    F.silu(gate) * up does; with a float32 row scale [R] (a routed expert's routing weight) that product
    times its row's scale in float32, rounded a third time, as torch's `.mul_(scale[:, None])` does.
  - `rope_triton`: RoPE's rotation x * cos + rotate_half(x) * sin of x [b, n, s, hd] (any strides, the last
    dim contiguous) in one pass: each product rounded to x's dtype, then their sum rounded, as torch's three
    ops do (bit for bit), written contiguous [b, n, s, hd] (the layout attention takes without another copy).
No FMA contraction (`enable_fp_fusion=False`): each product and sum rounds as written. The outputs are new
contiguous tensors. Launches are asynchronous on the current CUDA stream.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from engine.util._triton_cast import TL_DTYPES, round_to

_NORM_ELEMENTS = 4096        # elements per program when rows are narrow
_SILU_BLOCK = 1024           # elements of one row per program


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, n_cols, x_row, eps,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, OUT: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)              # [ROWS]
    c = tl.arange(0, BLOCK)                                                     # [BLOCK]
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    x = tl.load(x_ptr + r[:, None] * x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)  # [ROWS, BLOCK]
    mean = tl.math.div_rn(tl.sum(x * x, axis=1), n_cols * 1.0)                 # [ROWS]
    normed = round_to(x * tl.math.rsqrt(mean + eps)[:, None], OUT).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < n_cols, other=0.0).to(tl.float32)         # [BLOCK]
    tl.store(out_ptr + r[:, None] * n_cols + c[None, :], round_to(w[None, :] * normed, OUT), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, scale_ptr, out_ptr, n_cols, gate_row, up_row, OUT: tl.constexpr,
                     BLOCK: tl.constexpr, SCALED: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)             # [BLOCK]
    mask = c < n_cols
    g = tl.load(gate_ptr + r * gate_row + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + r * up_row + c, mask=mask, other=0.0).to(tl.float32)
    silu = round_to(tl.math.div_rn(g, 1.0 + tl.exp(-g)), OUT).to(tl.float32)   # F.silu in the input dtype
    y = round_to(silu * u, OUT)
    if SCALED:
        y = round_to(y.to(tl.float32) * tl.load(scale_ptr + r), OUT)            # the row's float32 scale
    tl.store(out_ptr + r * n_cols + c, y, mask=mask)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, S, N, x_b, x_n, x_s, c_b, c_s, s_b, s_s,
                 HALF: tl.constexpr, HEADS: tl.constexpr, BLOCK: tl.constexpr, OUT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                                         # b * S + s
    b, s = row // S, row % S
    d = tl.arange(0, BLOCK)                                                     # [BLOCK] >= 2 * HALF
    dmask = d < 2 * HALF
    partner = tl.where(d < HALF, d + HALF, d - HALF)                            # rotate_half's source
    c = tl.load(cos_ptr + b * c_b + s * c_s + d, mask=dmask, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + b * s_b + s * s_s + d, mask=dmask, other=0.0).to(tl.float32)
    for i in tl.static_range(HEADS):
        h = tl.program_id(1).to(tl.int64) * HEADS + i
        m = dmask & ((d * 0 + h) < N)                                           # [BLOCK] (a vector mask)
        src = x_ptr + b * x_b + h * x_n + s * x_s
        x = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
        xr = tl.load(src + partner, mask=m, other=0.0).to(tl.float32)
        xr = tl.where(d < HALF, -xr, xr)                                        # rotate_half(x)
        y = round_to(x * c, OUT).to(tl.float32) + round_to(xr * sn, OUT).to(tl.float32)
        tl.store(out_ptr + ((b * N + h) * S + s) * (2 * HALF) + d, round_to(y, OUT), mask=m)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [*lead, n] as [R, n] with a row stride and a contiguous last dim (a view when the leading dims fold,
    else a contiguous copy)."""
    flat = t.reshape(-1, t.shape[-1]) if t.dim() != 1 else t.reshape(1, -1)
    return flat if flat.stride(-1) == 1 or flat.shape[-1] == 1 else flat.contiguous()


def _on(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()  # cpu: interpreter


def _norm_warps(block: int) -> int:
    """Warps for rows of `block` elements: at most 32 float32 values of the row per thread (4 to 16)."""
    return min(16, max(4, block // (32 * 32)))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`elementwise.rms_norm_torch(x, weight, eps)` in one launch: x [*lead, h] float16/bfloat16/float32,
    weight [h] contiguous of x's dtype, h at most `elementwise.MAX_NORM_WIDTH` (one row per program, in
    registers; checked by the caller) -> [*lead, h] contiguous."""
    h = x.shape[-1]
    rows = _rows(x)                                                             # [R, h]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(h)
    per_program = max(1, _NORM_ELEMENTS // block)
    if rows.numel():
        with _on(x.device):
            _rms_norm_kernel[(triton.cdiv(rows.shape[0], per_program),)](
                rows, weight, out, rows.shape[0], h, rows.stride(0), eps, ROWS=per_program, BLOCK=block,
                OUT=TL_DTYPES[x.dtype], num_warps=_norm_warps(block), enable_fp_fusion=False)
    return out


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None) -> torch.Tensor:
    """`F.silu(gate) * up` in one launch: gate, up [*lead, n] of one float16/bfloat16/float32 dtype
    (checked by the caller) -> [*lead, n] contiguous: `out` when given (contiguous, gate's shape and dtype;
    gate itself works in place: each element is read before it is written); `scale` [*lead] float32
    (contiguous) multiplies each row of the product."""
    g, u = _rows(gate), _rows(up)                                               # [R, n] x 2
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if out is None else out
    if g.numel():
        with _on(gate.device):
            _silu_mul_kernel[(g.shape[0], triton.cdiv(g.shape[1], _SILU_BLOCK))](
                g, u, g if scale is None else scale, out, g.shape[1], g.stride(0), u.stride(0),
                OUT=TL_DTYPES[gate.dtype], BLOCK=_SILU_BLOCK, SCALED=scale is not None, enable_fp_fusion=False)
    return out


_ROPE_HEADS = 4              # heads per program (one cos/sin row read for them all)


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`elementwise.rope_torch(x, cos, sin)` in one launch: x [b, n, s, hd] float16/bfloat16/float32 with a
    contiguous last dim, cos/sin [b or 1, s, hd] of x's dtype with contiguous last dims, hd even (checked by
    the caller) -> [b, n, s, hd] contiguous."""
    b, n, s, hd = x.shape
    out = torch.empty((b, n, s, hd), dtype=x.dtype, device=x.device)
    if out.numel():
        cb = cos.stride(0) if cos.shape[0] != 1 else 0
        sb = sin.stride(0) if sin.shape[0] != 1 else 0
        with _on(x.device):
            _rope_kernel[(b * s, triton.cdiv(n, _ROPE_HEADS))](
                x, cos, sin, out, s, n, x.stride(0), x.stride(1), x.stride(2), cb, cos.stride(1), sb, sin.stride(1),
                HALF=hd // 2, HEADS=_ROPE_HEADS, BLOCK=triton.next_power_of_2(hd), OUT=TL_DTYPES[x.dtype],
                enable_fp_fusion=False)
    return out
