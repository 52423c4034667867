"""The torch-op path of 4-bit dequantization's unpack + affine step (any device), and the output view helper.

The reference both fused paths are checked against: `engine.quant.kernels.affine_dequant` dispatches here
off CUDA, and the Triton kernel (`engine.quant._dequant_triton`) uses `as_groups` and checks itself against
`affine_dequant_torch` on first use. A leaf module (torch only), so neither of those imports the other.
"""
from __future__ import annotations

import torch


def affine_dequant_torch(data: torch.Tensor, mn: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """The batched torch-op path of `affine_dequant` (any device; same contract)."""
    *lead, g, half = data.shape
    shape = (*lead, g, 2 * half)
    view = None if out is None else as_groups(out, shape)                      # [*lead, g, gs]
    if data.device.type == "cpu" and mn.dtype in _HALVES:
        target = view if view is not None else torch.empty(shape, dtype=out_dtype)
        _host_half_affine(data, mn, scale, target)
        return target
    if view is not None and mn.dtype == out_dtype:
        dense = view                                                            # affine step in place
    else:
        dense = torch.empty(shape, dtype=mn.dtype, device=data.device)          # [*lead, g, gs]
    _unpack(data, dense)
    torch.addcmul(mn, dense, scale, out=dense)                                  # [*lead, g, gs]
    if view is None:
        return dense.to(out_dtype)
    if view.data_ptr() != dense.data_ptr():
        view.copy_(dense)
    return view


_HALVES = (torch.float16, torch.bfloat16)


_HOST_BLOCK = 1 << 20      # elements per float32 block of the host's affine step (4 MiB: stays in cache)


def _host_half_affine(data: torch.Tensor, mn: torch.Tensor, scale: torch.Tensor, target: torch.Tensor) -> None:
    """mn + code * scale, rounded to mn's half dtype, into target [*lead, g, gs] (any dtype and strides: converted
    from there, as the torch path does), on the host in float32 blocks of at most `_HOST_BLOCK` elements along
    the leading dims. The host has no half arithmetic: torch's own half addcmul computes in float32 and rounds to
    the half dtype, and code * scale is exact in float32 (4 bits times an 8- or 11-bit mantissa), so this gives
    its bits, in less time and without a half-dtype copy of the whole tensor."""
    if target.dim() == 2 or target.numel() <= _HOST_BLOCK:
        wide = torch.empty(target.shape, dtype=torch.float32)                  # [*lead, g, gs]
        _unpack(data, wide)
        wide.mul_(scale).add_(mn)                                               # float32, one rounding
        if target.dtype != mn.dtype:
            # rounded to mn's dtype, then converted on from there as torch would (half -> float32 is exact,
            # so float32 -> target rounds as half -> target does, without the host's slow direct conversion)
            wide.copy_(wide.to(mn.dtype))
        target.copy_(wide)
        return
    per_row = target[0].numel()
    if per_row > _HOST_BLOCK:                                                   # a leading dim at a time
        for r in range(target.shape[0]):
            _host_half_affine(data[r], mn[r], scale[r], target[r])
        return
    rows = _HOST_BLOCK // per_row
    for r0 in range(0, target.shape[0], rows):
        r1 = r0 + rows
        _host_half_affine(data[r0:r1], mn[r0:r1], scale[r0:r1], target[r0:r1])


def _unpack(data: torch.Tensor, dense: torch.Tensor) -> None:
    """The codes of data [*lead, g, gs/2] (two per byte, low nibble first) into dense [*lead, g, gs]."""
    pairs = dense.unflatten(-1, (data.shape[-1], 2))                            # [*lead, g, gs/2, 2]
    pairs[..., 0].copy_(data & 0x0F)                                            # even elements: low nibble
    pairs[..., 1].copy_(data >> 4)                                              # odd elements: high nibble


def as_groups(out: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`out` ([*lead, g, gs] or [*lead, g*gs]) as a [*lead, g, gs] view (a split of the last dim is always
    a view)."""
    if tuple(out.shape) == shape:
        return out
    if tuple(out.shape) == (*shape[:-2], shape[-2] * shape[-1]):
        return out.unflatten(-1, shape[-2:])
    raise ValueError(f"affine_dequant: out must have shape {shape} or {(*shape[:-2], shape[-2] * shape[-1])}, "
                     f"got {tuple(out.shape)}")
