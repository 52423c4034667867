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


def dummy_tensor(key: str, spec: WeightSpec, dtype: torch.dtype) -> torch.Tensor:
    """A deterministic tensor of spec.shape for the weight called `key` (its seed is crc32(key))."""
    leaf = key.rsplit("/", 1)[-1]
    if leaf.endswith(".bias"):
        return torch.zeros(spec.shape, dtype=dtype)
    if len(spec.shape) == 1:
        return torch.ones(spec.shape, dtype=dtype)  # norm weights
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    block = (torch.randn(min(BLOCK, spec.numel), generator=g) * STD).to(dtype)  # [BLOCK]
    reps = -(-spec.numel // block.numel())
    return block.repeat(reps)[: spec.numel].view(spec.shape)


class DummySource:
    """A `WeightSource` with no files: every `get` makes the layer's tensors afresh (same values each time)."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype

    def get(self, spec: LayerSpec) -> dict[str, torch.Tensor]:
        return {
            local: dummy_tensor(f"{self.name}/{spec.name}/{local}", ws, self.dtype)
            for local, ws in spec.weights.items()
        }

    def nbytes(self, spec: LayerSpec) -> int:
        return layer_nbytes(spec, self.dtype)
