"""AWQ and GPTQ int4 checkpoint tensors -> `QTensor` (pure functions; the layouts as their packers write them).

Both store a linear layer's weight W [out, in] as 4-bit codes q, one integer zero point z and one scale s per
group of `group_size` consecutive inputs and per output: W[o, i] = (q[o, i] - z[o, g]) * s[o, g], g = i // gs.
That is our group-wise format exactly (engine.quant.qtensor: element = code * scale + mn, groups along the
last dim of [out, in]) with code = q, scale = s, mn = -z * s; so nothing is re-quantized. In float32 (the
min/scale precision of float32 models) mn + q * s equals (q - z) * s bit for bit (s is a float16 value, so
z * s and q * s fit float32's mantissa); for half dtypes the min/scale are float16 and -z * s rounds once.

AWQ, GEMM version (AutoAWQ `WQLinear_GEMM.from_linear`): qweight int32 [in, out / 8] packs 8 outputs per
int32, nibble k (bits 4k..4k+3) holding output 8c + AWQ_ORDER[k], AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7);
qzeros int32 [in / gs, out / 8] packs the zero points the same way; scales float16 [in / gs, out].

GPTQ (AutoGPTQ `QuantLinear.pack`): qweight int32 [in / 8, out] packs 8 consecutive inputs per int32 along
dim 0, nibble k of row r holding input 8r + k; qzeros int32 [groups, out / 8] packs 8 consecutive outputs,
nibble k holding output 8c + k, stored as z - 1 in the original "gptq" checkpoint format (`zero_offset` 1;
GPTQModel's "gptq_v2" stores z: offset 0); scales float16 [groups, out]; g_idx int32 [in], the group of each
input. With act-order (desc_act) g_idx is not i // gs: groups are not runs of consecutive inputs and cannot
be expressed in our format (`gptq_qtensor` raises).
"""
from __future__ import annotations

import sys

import torch

from engine.quant.config import QuantConfig
from engine.quant.qtensor import QTensor, scale_dtype

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)    # nibble k of an AWQ int32 holds column 8c + AWQ_ORDER[k]
_SHIFTS = tuple(range(0, 32, 4))


class UnsupportedInt4(ValueError):
    """A pre-quantized tensor whose layout our group-wise format cannot hold as it is."""


def unpack_nibbles(packed: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 `packed` -> uint8 codes with `dim` 8x longer: element 8c + order[k] of that dim is nibble k of
    packed element c. Temporaries stay near one byte per code (no int32 copy per nibble)."""
    packed = packed.to(torch.int32).movedim(dim, -1)                                # [..., n]
    codes = torch.empty((*packed.shape, 8), dtype=torch.uint8, device=packed.device)  # [..., n, 8] by column
    for k, shift in enumerate(_SHIFTS):
        codes[..., order[k]] = ((packed >> shift) & 0xF).to(torch.uint8)            # column 8c + order[k]
    return codes.flatten(-2).movedim(-1, dim)                                       # [..., 8n]


def pack_qtensor(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 dtype: torch.dtype) -> QTensor:
    """codes uint8 [out, in] (0..15), zeros / scales [out, groups] (integer zero points, scales) -> the QTensor
    of (codes - zeros) * scales with groups of `group_size` inputs (the last group zero-padded)."""
    out_f, in_f = codes.shape
    groups = -(-in_f // group_size)
    padded = torch.zeros((out_f, groups * group_size), dtype=torch.uint8)
    padded[:, :in_f] = codes
    grouped = padded.view(out_f, groups, group_size)                                # [out, g, gs]
    data = grouped[..., 0::2] | (grouped[..., 1::2] << 4)                           # [out, g, gs/2] low nibble first
    return _qtensor(data.reshape(out_f, -1), in_f, zeros, scales, group_size, dtype)


def _qtensor(data: torch.Tensor, in_f: int, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
             dtype: torch.dtype) -> QTensor:
    """Packed bytes [out, groups * gs / 2] (inputs 2m, 2m + 1 in the low, high nibble of byte m), zeros / scales
    [out, groups] -> the QTensor of W [out, in_f]."""
    out_f, groups = data.shape[0], -(-in_f // group_size)
    if zeros.shape != (out_f, groups) or scales.shape != (out_f, groups):
        raise UnsupportedInt4(f"zeros {list(zeros.shape)} / scales {list(scales.shape)} do not give one value per "
                              f"output and group of {group_size} of a weight [{out_f}, {in_f}] ({groups} groups)")
    sdt = scale_dtype(dtype)
    scale = scales.to(sdt)[..., None]                                               # [out, g, 1]
    mn = (-zeros.to(sdt) * scales.to(sdt))[..., None]                               # [out, g, 1]
    return QTensor(data.reshape(out_f, groups, -1).contiguous(), mn.contiguous(), scale.contiguous(),
                   torch.Size((out_f, in_f)), QuantConfig(bits=4, group_size=group_size), dtype)


def _whole_bytes(in_f: int, group_size: int) -> bool:
    """Whether the packed bytes need no padding or regrouping: whole groups of an even size, and int32 bytes in
    little-endian order (the fast paths read nibbles through a byte view)."""
    return in_f % group_size == 0 and group_size % 2 == 0 and sys.byteorder == "little"


_NIBBLES = 0x0F0F0F0F


def _awq_bytes(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ qweight int32 [in, out / 8] (in even) -> packed bytes [out, in / 2] without a byte per code: the
    nibbles of rows 2m and 2m + 1 side by side in one int32 op, then each byte to its output column."""
    a, b = qweight[0::2].to(torch.int32), qweight[1::2].to(torch.int32)            # [in/2, out/8]
    low = ((a & _NIBBLES) | ((b & _NIBBLES) << 4)).view(torch.uint8)               # byte j: nibble 2j of a and b
    high = (((a >> 4) & _NIBBLES) | (((b >> 4) & _NIBBLES) << 4)).view(torch.uint8)   # nibble 2j + 1
    rows, cols = a.shape
    out = torch.empty((rows, cols, 8), dtype=torch.uint8)                          # [in/2, out/8, 8] by column
    for k in range(8):
        src = low if k % 2 == 0 else high
        out[..., AWQ_ORDER[k]] = src.view(rows, cols, 4)[..., k // 2]
    return out.view(rows, cols * 8).t().contiguous()                               # [out, in/2]


def awq_qtensor(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                dtype: torch.dtype) -> QTensor:
    """AWQ GEMM tensors (module docstring) -> QTensor of W [out, in]."""
    zeros = unpack_nibbles(qzeros, 1, AWQ_ORDER).t()                               # [out, groups]
    in_f = qweight.shape[0]
    if _whole_bytes(in_f, group_size):
        return _qtensor(_awq_bytes(qweight), in_f, zeros, scales.t(), group_size, dtype)
    codes = unpack_nibbles(qweight, 1, AWQ_ORDER).t()                              # [out, in]
    return pack_qtensor(codes.contiguous(), zeros, scales.t(), group_size, dtype)


def check_g_idx(g_idx: torch.Tensor, in_features: int, group_size: int) -> None:
    """UnsupportedInt4 unless GPTQ's g_idx [in] is input // group_size (no act-order permutation)."""
    expected = torch.arange(in_features, dtype=torch.int64) // group_size
    if tuple(g_idx.shape) != (in_features,) or not torch.equal(g_idx.to(torch.int64), expected):
        raise UnsupportedInt4(f"g_idx is not input // group_size (act-order / desc_act): groups of {group_size} "
                              "consecutive inputs are required")


def gptq_qtensor(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                 group_size: int, dtype: torch.dtype, zero_offset: int = 1) -> QTensor:
    """GPTQ tensors (module docstring) -> QTensor of W [out, in]; UnsupportedInt4 when g_idx is not i // gs."""
    in_f = qweight.shape[0] * 8
    if g_idx is not None:
        check_g_idx(g_idx, in_f, group_size)
    zeros = unpack_nibbles(qzeros, 1).t().to(torch.int16) + zero_offset           # [out, groups]
    if _whole_bytes(in_f, group_size):
        # an int32 of GPTQ's holds inputs 8r..8r+7 low nibble first: our bytes already, once transposed
        data = qweight.to(torch.int32).t().contiguous().view(torch.uint8)          # [out, in/2]
        return _qtensor(data, in_f, zeros, scales.t(), group_size, dtype)
    codes = unpack_nibbles(qweight, 0).t()                                         # [out, in]
    return pack_qtensor(codes.contiguous(), zeros, scales.t(), group_size, dtype)
