"""Dummy weights made on demand: deterministic, cheap, small-magnitude (for benchmarks of huge shapes).

Each matrix is a seeded random block of BLOCK values (std 0.02, HF's init scale) tiled to its size: making
a 1 GB layer costs a memcpy, not a normal_ init. Norm weights are ones and biases zeros, so activations
stay finite through any depth.
"""
from __future__ import annotations

import zlib

import torch

from engine.models.base import LayerSpec, WeightSpec
from engine.models.weights import layer_nbytes

BLOCK = 65537  # prime, so tiled rows do not repeat in lockstep
STD = 0.02


def dummy_tensor(key: str, spec: WeightSpec, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """A deterministic tensor of spec.shape for the weight called `key` (its seed is crc32(key)), made on
    `device` (the same values on every device)."""
    return fill_dummy_(key, torch.empty(spec.shape, dtype=dtype, device=device))


def fill_dummy_(key: str, t: torch.Tensor) -> torch.Tensor:
    """Fill the contiguous `t` in place with `dummy_tensor`'s values for the weight called `key` (biases zero,
    other 1-D weights one, matrices the seeded block tiled in one write pass on t's device: the block is drawn
    on the host and moved there first); returns t."""
    if key.rsplit("/", 1)[-1].endswith(".bias"):
        return t.zero_()
    if t.dim() == 1:
        return t.fill_(1)  # norm weights
    if t.numel() == 0:
        return t
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    block = (torch.randn(min(BLOCK, t.numel()), generator=g) * STD).to(t.dtype).to(t.device)  # [B]
    flat, b = t.view(-1), block.numel()                                          # [numel]
    whole = flat.numel() // b
    flat[: whole * b].view(whole, b).copy_(block.expand(whole, b))               # [whole, B]
    flat[whole * b:].copy_(block[: flat.numel() - whole * b])
    return t


class DummySource:
    """A `WeightSource` with no files: every `get` makes the layer's tensors afresh (same values each time)."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype

    def get(self, spec: LayerSpec) -> dict[str, torch.Tensor]:
        return {local: self.tensor(spec, local) for local in spec.weights}

    def tensor(self, spec: LayerSpec, local: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """The one weight `local` of layer `spec`, made on `device` (what `get` holds for it, bit for bit):
        placement quantizing on a GPU makes each weight there, with no dense host copy to fill and move."""
        return dummy_tensor(f"{self.name}/{spec.name}/{local}", spec.weights[local], self.dtype, device)

    def nbytes(self, spec: LayerSpec) -> int:
        return layer_nbytes(spec, self.dtype)
