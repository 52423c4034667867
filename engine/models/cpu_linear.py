"""Weight matrices held in the form a CPU multiplies fastest, and `linear` over any of them.

Two packed forms, both made once when the weights are placed (`pack_weight`), never per call:
  - `onednn`: a dense bfloat16 matrix reordered into oneDNN's blocked layout (an opaque `torch._mkldnn`
    tensor). `F.linear` on a bfloat16 CPU matrix runs the same oneDNN kernel but reorders the whole
    matrix on every call, which at a decode step costs more than the product (a 49152 x 576 head: the
    reorder is the call's time at 1 row and at 64); packed, the products are bit for bit those of `F.linear`
    at the rows of a decode step or of one prompt's prefill; at a few hundred rows (a batched prefill chunk)
    `F.linear` may pick another accumulation order and differ in the last bits.
  - `Int4Linear`: a bfloat16 model's 4-bit `QTensor` (asymmetric min/scale groups along the input dim) as the
    operands of `torch.ops.aten._weight_int4pack_mm_for_cpu`: the same codes, repacked; scale and zero
    (mn + 8 x scale: the kernel computes (code - 8) x scale + zero) rounded to bfloat16, the one input dtype
    the kernel vectorizes (float16 and float32 inputs take a scalar path 40-60x slower). The rounding of
    scale and zero moves a weight by at most 1/64 of its group's step, what rounding the dequantized weight
    to bfloat16 moves it by. The kernel takes a 2-D input; leading dims are flattened. Groups of 32, 64,
    128 or 256 that tile the input dim exactly. A float32 model keeps dequantizing (its products are the
    parity reference). Past its crossing it multiplies the QTensor dequantized on every call, or, with a
    dense copy (`Policy.cpu_dense_copy`: a bfloat16 matrix more per weight), the same dequantized matrix
    reordered once into oneDNN's layout: the same products (those of `F.linear` over that matrix, as above)
    without the dequantization.
Which weights a family reads only through `linear` is its `LINEAR_WEIGHTS` (data on the family class);
others are never packed. benchmarks/kernels/cpu_linear_speed.py measures every form per batch size.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.quant.config import int4_kernel_parts
from engine.quant.group import dequantize
from engine.quant.qtensor import QTensor

# rows the int4 kernel multiplies before dequantizing + a GEMM is faster: on a 2-core AVX-512 machine the kernel
# is ahead up to 64 rows at SmolLM2's shapes (dequantizing one of its matrices costs what 64 rows of the
# kernel do); a machine's own crossing is measured once (engine.calibrate.cpu_dtype) and passed down by the facade
INT4_MAX_ROWS = 64
# rows the int4 kernel multiplies before a GEMM over a dense copy packed once is faster: a packed GEMM costs no
# dequantization, so the kernel is ahead only while reading a quarter of the bytes wins (a few rows; measured
# per machine likewise)
INT4_DENSE_MAX_ROWS = 4
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default      # the overload, resolved once


class Int4Linear:
    """A [n, k] weight as `_weight_int4pack_mm_for_cpu`'s packed codes and bfloat16 scale/zero, and its
    QTensor (the operands `engine.quant.config.int4_kernel_parts` names). Up to `max_rows` rows multiply in
    the int4 kernel (a decode step); more rows (a prefill chunk) multiply `dense` when given (the dequantized
    matrix packed once, `dense_copy`), else the QTensor dequantized to bfloat16 on each call (into `scratch`
    when given: a run's planned dense copy, shared by the layers of a kind, which a CPU computes one after
    another): the kernel's time grows with the rows, a dense GEMM's barely
    (benchmarks/kernels/cpu_linear_speed.py), so past the crossing a dense GEMM wins. Both dense paths
    multiply the same dequantized matrix (the packed one as `F.linear` does, module docstring)."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, q: QTensor, max_rows: int,
                 scratch: torch.Tensor | None = None, dense: torch.Tensor | None = None) -> None:
        self.packed = packed                  # [n, k/2] uint8
        self.scales_zeros = scales_zeros      # [k/gs, n, 2] bfloat16
        self.q = q                            # the codes as stored, [n, k] logical
        self.scratch = scratch                # [n, k] bfloat16 the dequantized weight is written to, or None
        self.dense = dense                    # [n, k] bfloat16 in oneDNN's layout, or None
        self.group_size = q.config.group_size
        self.shape = torch.Size(q.shape)      # logical [n, k]
        self.dtype = q.dtype                  # bfloat16: the dtype products come in and go out in
        self.max_rows = max_rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., k] bfloat16 -> [..., n] bfloat16."""
        rows = x.reshape(-1, x.shape[-1])                                                           # [r, k]
        if rows.shape[0] > self.max_rows:
            if self.dense is not None:
                return linear(x, self.dense, bias)                                                  # [..., n]
            return F.linear(x, dequantize(self.q, out=self.scratch), bias)                        # [..., n]
        y = _INT4_MM(rows, self.packed, self.group_size, self.scales_zeros).view(*x.shape[:-1], self.shape[0])
        return y if bias is None else y + bias


def int4_packable(q: QTensor) -> bool:
    """True when `q` is a CPU QTensor the int4 kernel takes (`engine.quant.config.int4_kernel_parts`: 2-D,
    bfloat16, unrotated, a group size it supports tiling the input dim)."""
    return (q.device.type == "cpu" and q.data.shape[-1] * 2 == q.config.group_size
            and bool(int4_kernel_parts(tuple(q.shape), str(q.dtype).removeprefix("torch."), q.config)))


def pack_int4(q: QTensor, max_rows: int = INT4_MAX_ROWS, into: tuple[torch.Tensor, torch.Tensor] | None = None,
              scratch: torch.Tensor | None = None, dense: torch.Tensor | None = None) -> Int4Linear:
    """`q` [n, k] (`int4_packable`) -> the same codes, scales and mins as an `Int4Linear` that runs the int4
    kernel for up to `max_rows` rows. `into`: the buffers [n, k/2] uint8 and [k/group, n, 2] bfloat16 its
    operands are written to (a run's planned `packed.*` buffers; default: tensors of their own); `scratch`,
    `dense` (`dense_copy(q)`): `Int4Linear`'s."""
    n, k = q.shape
    gs = q.config.group_size
    codes = torch.stack((q.data & 15, q.data >> 4), dim=-1).reshape(n, k).to(torch.int32)    # [n, k] low first
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)                     # [n, k/2] uint8
    scale = q.scale.float().reshape(n, k // gs)                                               # [n, g]
    zero = q.mn.float().reshape(n, k // gs) + 8 * scale                                       # [n, g]
    scales_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [g, n, 2]
    if into is not None:
        packed, scales_zeros = into[0].copy_(packed), into[1].copy_(scales_zeros)
    return Int4Linear(packed, scales_zeros, q, max_rows, scratch, dense)


def dense_copy(q: QTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`q` [n, k] (`int4_packable`) dequantized (into `out` [n, k] bfloat16 when given, a run's planned
    `packed.*.dense` buffer) and reordered once into oneDNN's layout: `Int4Linear`'s `dense`. `out` is free
    again once this returns (the reordered matrix is a tensor of its own, as many bytes)."""
    return pack_onednn(dequantize(q, out=out))                                                 # [n, k] oneDNN


@functools.lru_cache(maxsize=None)
def onednn_bf16() -> bool:
    """True when this torch build runs bfloat16 oneDNN matmuls on this CPU."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_onednn(w: torch.Tensor) -> torch.Tensor:
    """A dense bfloat16 CPU matrix [n, k] reordered once into oneDNN's layout (`linear` multiplies it)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, None)


def pack_weight(value: torch.Tensor | QTensor, int4_max_rows: int = INT4_MAX_ROWS
                ) -> torch.Tensor | QTensor | Int4Linear:
    """`value` in the packed form this CPU multiplies fastest, or unchanged when none applies: a 4-bit
    matrix -> `Int4Linear` (the int4 kernel up to `int4_max_rows` rows); a dense bfloat16 matrix -> oneDNN's
    layout; float32 stays dense (MKL's GEMM reads it as it is, and it is the parity reference)."""
    if isinstance(value, QTensor):
        return pack_int4(value, int4_max_rows) if int4_packable(value) else value
    if value.device.type == "cpu" and value.dim() == 2 and value.dtype == torch.bfloat16 and onednn_bf16():
        return pack_onednn(value.contiguous())
    return value


def linear(x: torch.Tensor, weight: torch.Tensor | Int4Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias [out]) -> [..., out] for a dense, oneDNN-packed or int4 weight."""
    if isinstance(weight, Int4Linear):
        return weight(x, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
