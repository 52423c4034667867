"""Pure tensor functions shared by the model families: norms, linear, RoPE, activations.

The attention core and masks are in `engine.models.attention`.

Nothing here owns state or placement: every function computes on the device and dtype of its inputs.
Shapes: b batch, s new tokens, t total (past + new) tokens, h hidden, n heads, nkv key/value heads,
hd head_dim.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face Llama computes it: statistics in float32, weight applied in x's dtype."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim (OPT)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias [out]) -> [..., out]."""
    return F.linear(x, weight, bias)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function called `name` in Hugging Face configs (`hidden_act`, OPT `activation_function`)."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}") from None


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [hd/2] float32 for `config.rope_theta` and `config.rope_scaling`.

    Matches transformers' ROPE_INIT_FUNCTIONS for "default", "linear" and "llama3"."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))  # [hd/2]
    scaling: dict[str, Any] = dict(config.rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency smoothing: long wavelengths divided by `factor`, a smooth blend in between."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_context / low
    high_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq  # [hd/2]
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [b, s] int64 -> cos, sin [b, s, hd] in `dtype` (computed in float32, as transformers does)."""
    freqs = positions[..., None].to(torch.float32) * inv_freq.to(positions.device, torch.float32)  # [b, s, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [b, s, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RopeTable:
    """cos/sin of positions 0..n-1 per (device, dtype), built once and gathered per layer.

    Values equal `rope_cos_sin`'s (float32 products, cast to `dtype` last); the table grows by doubling when
    a larger position appears, so a decode step costs one gather per layer instead of a cos and a sin."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq  # [hd/2] float32
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b, s] int64 -> cos, sin [b, s, hd] in `dtype`."""
        key = (positions.device, dtype)
        cos, sin = self._tables.get(key, (None, None))
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if cos is None or cos.shape[0] < needed:
            size = max(needed, 2 * (0 if cos is None else cos.shape[0]), 256)
            grid = torch.arange(size, device=positions.device)[None, :]  # [1, n]
            cos, sin = rope_cos_sin(self.inv_freq, grid, dtype)  # [1, n, hd]
            cos, sin = cos[0], sin[0]  # [n, hd]
            self._tables[key] = (cos, sin)
        return F.embedding(positions, cos), F.embedding(positions, sin)  # [b, s, hd]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, n, s, hd], cos/sin [b, s, hd] -> x rotated (the half-split layout of Hugging Face Llama)."""
    cos = cos.unsqueeze(1)  # [b, 1, s, hd]
    sin = sin.unsqueeze(1)  # [b, 1, s, hd]
    return x * cos + _rotate_half(x) * sin
