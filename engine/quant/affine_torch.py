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
    if view is not None and mn.dtype == out_dtype:
        dense = view                                                            # affine step in place
    else:
        dense = torch.empty(shape, dtype=mn.dtype, device=data.device)          # [*lead, g, gs]
    pairs = dense.unflatten(-1, (half, 2))                                      # [*lead, g, gs/2, 2]
    pairs[..., 0].copy_(data & 0x0F)                                            # even elements: low nibble
    pairs[..., 1].copy_(data >> 4)                                              # odd elements: high nibble
    torch.addcmul(mn, dense, scale, out=dense)                                  # [*lead, g, gs]
    if view is None:
        return dense.to(out_dtype)
    if view.data_ptr() != dense.data_ptr():
        view.copy_(dense)
    return view


def as_groups(out: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`out` ([*lead, g, gs] or [*lead, g*gs]) as a [*lead, g, gs] view (a split of the last dim is always
    a view)."""
    if tuple(out.shape) == shape:
        return out
    if tuple(out.shape) == (*shape[:-2], shape[-2] * shape[-1]):
        return out.unflatten(-1, shape[-2:])
    raise ValueError(f"affine_dequant: out must have shape {shape} or {(*shape[:-2], shape[-2] * shape[-1])}, "
                     f"got {tuple(out.shape)}")
