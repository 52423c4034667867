"""Unpack + affine step of 4-bit dequantization: `affine_dequant`, one fused pass where the device allows.

Input layout (a `QTensor`'s parts): `data` uint8 [*lead, g, gs/2] holding element 2i of a group in the low
nibble and 2i+1 in the high nibble of byte i; `mn`, `scale` [*lead, g, 1] float16 or float32. Output
[*lead, g, gs] = mn + code * scale, evaluated exactly as `torch.addcmul(mn, code, scale)` does (float32
arithmetic, one rounding to mn's dtype), then cast to `out_dtype`.

Two paths, same values:
  - CUDA tensors with Triton importable: one Triton kernel reads each packed byte and each min/scale once
    and writes the dense result once, straight into `out` when `out` is contiguous or a slice of the
    positions of a larger buffer (see `_dequant_triton._plan`). Triton is imported on the first such call
    only (`engine` imports without Triton installed).
  - elsewhere: batched torch ops that write the low/high codes straight into the even/odd slots of the
    result (`out` itself, strided or not) and apply the affine step in place: two small uint8 temporaries,
    no stack/cat/copy of the dense tensor, except one dense temporary in mn's dtype when out_dtype differs
    from it (bfloat16 results from float16 min/scale).
The first CUDA call per device compiles the kernel and checks it against the torch path (one synchronize);
a failure there warns and keeps the torch path for that device.
All ops are asynchronous on CUDA (enqueued on the current stream), synchronous on the CPU.
"""
from __future__ import annotations

import functools

import torch

from engine.quant.affine_torch import affine_dequant_torch
from engine.util.kernel_check import first_use_check

_SCALE_DTYPES = (torch.float16, torch.float32)


def affine_dequant(data: torch.Tensor, mn: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense [*lead, g, gs] of `out_dtype` from data [*lead, g, gs/2] uint8 and mn/scale [*lead, g, 1].

    `out`, when given, must be on data's device with dtype `out_dtype` and lead*g*gs elements (shaped
    [*lead, g, gs] or [*lead, g*gs]); it is filled and a [*lead, g, gs] view of it is returned. Any input
    may be a strided view (e.g. a KV cache sliced along positions). Raises ValueError on a mismatch,
    naming the argument at fault.
    """
    _check(data, mn, scale, out_dtype, out)
    if data.is_cuda and _triton_ready(data.get_device()):
        from engine.quant import _dequant_triton    # optional dependency: Triton, imported on CUDA only

        return _dequant_triton.affine_dequant_triton(data, mn, scale, out_dtype, out)
    return affine_dequant_torch(data, mn, scale, out_dtype, out)


def _check(data: torch.Tensor, mn: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
           out: torch.Tensor | None) -> None:
    if data.dtype != torch.uint8 or data.dim() < 2:
        raise ValueError(f"affine_dequant: data must be uint8 [*lead, g, gs/2], got {data.dtype} "
                         f"{tuple(data.shape)}")
    want = (*data.shape[:-1], 1)
    for name, t in (("mn", mn), ("scale", scale)):
        if tuple(t.shape) != want:
            raise ValueError(f"affine_dequant: {name} must have shape {want}, got {tuple(t.shape)}")
        if t.dtype not in _SCALE_DTYPES or t.device != data.device:
            raise ValueError(f"affine_dequant: {name} must be float16/float32 on {data.device}, got "
                             f"{t.dtype} on {t.device}")
    if scale.dtype != mn.dtype:
        raise ValueError(f"affine_dequant: scale dtype {scale.dtype} differs from mn dtype {mn.dtype}")
    if out is None:
        return
    if out.dtype != out_dtype or out.device != data.device:
        raise ValueError(f"affine_dequant: out must be {out_dtype} on {data.device}, got {out.dtype} on "
                         f"{out.device}")


@functools.lru_cache(maxsize=None)
def _triton_ready(device_index: int) -> bool:
    """True when Triton imports and its kernel matches the torch path on a small input on cuda:device_index
    (checked once per device; synchronizes that once). Otherwise warns once and the torch path is used."""
    def check() -> bool:
        from engine.quant import _dequant_triton    # optional dependency: Triton (absent: torch path)

        return _dequant_triton.self_check(torch.device("cuda", device_index))

    return first_use_check("affine_dequant", f"cuda:{device_index}", check)
