"""The fused Triton kernel behind `engine.quant.kernels.affine_dequant` on CUDA (imports Triton: load lazily).

Inputs and output are seen as A rows with a row stride each (data in bytes, mn/scale in groups, the output
in elements) and a contiguous run of M packed bytes (M / (gs/2) groups, 2M outputs) per row: this covers
contiguous tensors (A = 1) and a KV cache or its dense buffer sliced along positions (A = batch * heads).
Any other layout is made contiguous first (packed data is a quarter of the fp16 output). One program
handles BLOCK packed bytes of one row: it loads them once, loads each byte's min/scale (cached), and stores
2 * BLOCK dense values interleaved (low nibble first).
"""
from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from engine.quant.affine_torch import affine_dequant_torch, as_groups

_BLOCK = 1024          # packed bytes per program (2048 outputs)

TL_DTYPES = {torch.float16: tl.float16, torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}


@triton.jit
def round_as_addcmul(x, MID: tl.constexpr, OUT: tl.constexpr):
    """float32 x -> OUT through MID (mn's dtype), each step round-to-nearest-even like torch's casts."""
    if MID == tl.float16:
        x = x.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
    if OUT == tl.bfloat16:                                           # rtne by hand: exact in the interpreter too
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(OUT)


@triton.jit
def _affine_dequant_kernel(data_ptr, mn_ptr, scale_ptr, out_ptr, M, num_blocks, data_row, mn_row, scale_row, out_row,
                           HALF: tl.constexpr, MID: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = (pid // num_blocks).to(tl.int64)
    start = (pid % num_blocks).to(tl.int64) * BLOCK
    m = start + tl.arange(0, BLOCK)                                   # byte index within the row
    mask = m < M
    byte = tl.load(data_ptr + row * data_row + m, mask=mask, other=0)
    grp = m // HALF
    mn = tl.load(mn_ptr + row * mn_row + grp, mask=mask, other=0.0).to(tl.float32)
    sc = tl.load(scale_ptr + row * scale_row + grp, mask=mask, other=0.0).to(tl.float32)
    lo = tl.fma((byte & 15).to(tl.float32), sc, mn)                   # float32 with one rounding, as the
    hi = tl.fma((byte >> 4).to(tl.float32), sc, mn)                   # CPU's addcmul; exact for half mn/scale
    lo = round_as_addcmul(lo, MID, OUT)
    hi = round_as_addcmul(hi, MID, OUT)
    o = 2 * start + tl.arange(0, 2 * BLOCK)                           # output index within the row
    tl.store(out_ptr + row * out_row + o, tl.interleave(lo, hi), mask=o < 2 * M)


def _plan(data: torch.Tensor, mn: torch.Tensor, scale: torch.Tensor,
          dense: torch.Tensor) -> tuple[int, int, list[int]] | None:
    """(A rows, M packed bytes per row, row strides of data/mn/scale/dense) when the layout fits the kernel
    (lead dims = a foldable outer part times a part contiguous with the groups), else None."""
    g, half = data.shape[-2:]
    units = ((data, g * half), (mn, g), (scale, g), (dense, g * 2 * half))
    inner = data.stride(-1) == 1 and dense.stride(-1) == 1
    if not inner or (g > 1 and (data.stride(-2) != half or mn.stride(-2) != 1 or scale.stride(-2) != 1
                                or dense.stride(-2) != 2 * half)):
        return None
    dims = [i for i in range(data.dim() - 2) if data.shape[i] != 1]  # size-1 lead dims carry no layout
    sizes = [data.shape[i] for i in dims]
    k, run = len(dims), 1                                               # lead dims [k:] contiguous in all
    while k > 0 and all(t.stride(dims[k - 1]) == u * run for t, u in units):
        k -= 1
        run *= sizes[k]
    for i in range(k - 1):                                              # dims [:k] must fold into one
        if not all(t.stride(dims[i]) == t.stride(dims[i + 1]) * sizes[i + 1] for t, _ in units):
            return None
    strides = [t.stride(dims[k - 1]) if k else 0 for t, _ in units]
    return math.prod(sizes[:k]), run * g * half, strides


def affine_dequant_triton(data: torch.Tensor, mn: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """`affine_dequant` by one kernel launch on the current CUDA stream (asynchronous), written straight
    into `out` when its layout fits `_plan` (contiguous, or a slice of the positions of a larger buffer).
    Arguments are checked by the caller."""
    *lead, g, half = data.shape
    shape = (*lead, g, 2 * half)
    view = None if out is None else as_groups(out, shape)                     # [*lead, g, gs]
    dense = view if view is not None else torch.empty(shape, dtype=out_dtype, device=data.device)
    plan = _plan(data, mn, scale, dense)
    if plan is None:
        data, mn, scale = data.contiguous(), mn.contiguous(), scale.contiguous()
        if _plan(data, mn, scale, dense) is None:
            dense = torch.empty(shape, dtype=out_dtype, device=data.device)
        plan = _plan(data, mn, scale, dense)
    rows, M, (d_row, m_row, s_row, o_row) = plan
    if dense.numel():
        num_blocks = triton.cdiv(M, _BLOCK)
        on_device = torch.cuda.device(data.device) if data.is_cuda else contextlib.nullcontext()  # cpu: interpreter
        with on_device:
            _affine_dequant_kernel[(rows * num_blocks,)](
                data, mn, scale, dense, M, num_blocks, d_row, m_row, s_row, o_row,
                HALF=half, MID=TL_DTYPES[mn.dtype], OUT=TL_DTYPES[out_dtype], BLOCK=_BLOCK)
    if view is None:
        return dense
    if dense is not view:
        view.copy_(dense)
    return view


def self_check(device: torch.device) -> bool:
    """Run the kernel once on a small strided input on `device` and compare it with the CPU torch path (bit
    for bit; float32 within a rounding); raises RuntimeError naming the dtype on a mismatch (compiles the
    kernel; synchronizes)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    for dtype, sdt in ((torch.float16, torch.float16), (torch.bfloat16, torch.float16), (torch.float32, torch.float32)):
        data = torch.randint(0, 256, (2, 3, 5, 2, 32), dtype=torch.uint8, generator=gen).to(device)[:, :, 1:4]
        mn = torch.randn(2, 3, 5, 2, 1, generator=gen).to(device, sdt)[:, :, 1:4]
        scale = torch.rand(2, 3, 5, 2, 1, generator=gen).to(device, sdt)[:, :, 1:4]
        got = affine_dequant_triton(data, mn, scale, dtype)
        want = affine_dequant_torch(data.cpu(), mn.cpu(), scale.cpu(), dtype)
        exact = torch.equal(got.cpu(), want)
        if not exact and (dtype != torch.float32 or not torch.allclose(got.cpu(), want, rtol=2 ** -20, atol=1e-6)):
            raise RuntimeError(f"the Triton dequant kernel differs from the torch path for {dtype}")
    return True
