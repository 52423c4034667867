"""Pure tensor functions shared by the model families: norms, linear, RoPE, activations.

The attention core and masks are in `engine.models.attention`; RMSNorm, the fused silu(gate) * up and RoPE's
rotation (one Triton kernel each on CUDA) in `engine.models.elementwise` (`rms_norm` is re-exported here).

Nothing here owns state or placement: every function computes on the device and dtype of its inputs.
Shapes: b batch, s new tokens, t total (past + new) tokens, h hidden, n heads, nkv key/value heads,
hd head_dim.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from engine.models import cpu_linear
from engine.models.config import ModelConfig
from engine.models.cpu_linear import Int4Linear
from engine.models.elementwise import rms_norm, rope, silu_mul  # noqa: F401  (rms_norm: re-exported for the families)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "freq_factors", "yarn")


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim (OPT)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def linear(x: torch.Tensor, weight: torch.Tensor | Int4Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias [out]) -> [..., out]; a weight packed for the CPU
    (`engine.models.cpu_linear`) by its own kernel."""
    return cpu_linear.linear(x, weight, bias)


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


def gated_activation(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(gate, up) -> act(gate) * up for the activation called `name` (a GLU MLP's middle): SiLU by
    `elementwise.silu_mul` (one fused pass on CUDA), any other activation by its function and a product."""
    if _ACTIVATIONS.get(name) is F.silu:
        return silu_mul
    act = activation(name)
    return lambda gate, up: act(gate) * up


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [hd/2] float32 for `config.rope_theta` and `config.rope_scaling`.

    Matches transformers' ROPE_INIT_FUNCTIONS for "default", "linear" and "llama3"; for "longrope" these are
    the short-context frequencies (see `rope_table` for the long ones and the attention factor);
    "freq_factors" divides each frequency by llama.cpp's per-frequency factor (a GGUF's `rope_freqs` tensor,
    which is how llama.cpp's converter stores Llama-3.1 scaling: the llama3 formula's divisors); "yarn" blends
    interpolated and original frequencies (`_yarn_inv_freq`; its attention factor is `yarn_attention_factor`)."""
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
    if rope_type == "longrope":
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32)
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, dim, base, _yarn_factor(config), scaling)
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


def _yarn_factor(config: ModelConfig) -> float:
    scaling = config.rope_scaling or {}
    factor = scaling.get("factor")
    return float(factor) if factor else config.max_position_embeddings / float(scaling["original_max_position_embeddings"])


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, factor: float,
                   scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (transformers' `_compute_yarn_parameters`): frequencies that turn fewer than beta_slow times over
    the original context are divided by `factor`, those turning more than beta_fast times are kept, a linear
    ramp over the dims in between."""
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [hd/2]
    keep = 1 - ramp                                                                            # extrapolation share
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def yarn_attention_factor(config: ModelConfig) -> float:
    """YaRN's cos/sin factor: `attention_factor`, else mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    when both are given, else mscale(factor) = 0.1 ln(factor) + 1 (1 for factor <= 1)."""
    scaling = config.rope_scaling or {}
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(config)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(float(m)) / mscale(float(m_all)) if m and m_all else mscale()


def _longrope(config: ModelConfig) -> tuple[torch.Tensor, int, float]:
    """LongRoPE ("su", Phi3): (long-context inverse frequencies [hd/2], the position from which they apply
    (original_max_position_embeddings), the cos/sin factor sqrt(1 + ln(factor) / ln(original)))."""
    scaling = dict(config.rope_scaling or {})
    original = int(scaling["original_max_position_embeddings"])
    base = rope_inv_freq(replace(config, rope_scaling=None))  # [hd/2]
    factor = float(scaling.get("factor") or config.max_position_embeddings / original)
    mscale = scaling.get("attention_factor")
    if mscale is None:
        mscale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return base / torch.tensor(scaling["long_factor"], dtype=torch.float32), original, float(mscale)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, mscale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [b, s] int64 -> cos, sin [b, s, hd] in `dtype` (computed in float32, as transformers does;
    times `mscale` before the cast when it is not 1, LongRoPE's attention factor)."""
    freqs = positions[..., None].to(torch.float32) * inv_freq.to(positions.device, torch.float32)  # [b, s, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [b, s, hd]
    cos, sin = emb.cos(), emb.sin()
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    return cos.to(dtype), sin.to(dtype)


class RopeTable:
    """cos/sin of positions 0..n-1 per (device, dtype), built once and gathered per layer.

    Values equal `rope_cos_sin`'s (float32 products, cast to `dtype` last); the table grows by doubling when
    a larger position appears, so a decode step costs one gather per layer instead of a cos and a sin.
    LongRoPE: positions from `switch` on use `long_inv_freq` (transformers switches the whole sequence once
    it is longer than the original context; per position, a cached key never changes), all times `mscale`."""

    def __init__(self, inv_freq: torch.Tensor, long_inv_freq: torch.Tensor | None = None, switch: int = 0,
                 mscale: float = 1.0) -> None:
        self.inv_freq = inv_freq  # [hd/2] float32
        self.long_inv_freq, self.switch, self.mscale = long_inv_freq, switch, mscale
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._reserved: set[tuple[torch.device, torch.dtype]] = set()   # keys whose lookups skip the check
        self._last: tuple | None = None          # (positions, dtype, cos, sin) of the last lookup

    def reserve(self, n: int, device: torch.device, dtype: torch.dtype) -> None:
        """Promise that lookups on (device, dtype) see positions below n (the executor's cache length): the
        table is grown to n now, and those lookups skip reading positions.max(), a host-device sync per
        attention layer that kept the host from running ahead of the GPU (one per layer, chunk and step)."""
        key = (torch.empty(0, device=device).device, dtype)      # canonical: "cuda" -> "cuda:0", as tensors say
        self._grow(key, n)
        self._reserved.add(key)

    def _grow(self, key: tuple[torch.device, torch.dtype], needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._tables.get(key, (None, None))
        if cos is None or cos.shape[0] < needed:
            device, dtype = key
            size = max(needed, 2 * (0 if cos is None else cos.shape[0]), 256)
            grid = torch.arange(size, device=device)[None, :]  # [1, n]
            cos, sin = rope_cos_sin(self.inv_freq, grid, dtype, self.mscale)  # [1, n, hd]
            cos, sin = cos[0], sin[0]  # [n, hd]
            if self.long_inv_freq is not None and size > self.switch:
                lcos, lsin = rope_cos_sin(self.long_inv_freq, grid[:, self.switch:], dtype, self.mscale)
                cos, sin = torch.cat((cos[:self.switch], lcos[0])), torch.cat((sin[:self.switch], lsin[0]))
            self._tables[key] = (cos, sin)
        return cos, sin

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b, s] int64 -> cos, sin [b, s, hd] in `dtype` (below a `reserve`d bound without a sync).
        The last lookup is remembered by the positions tensor itself: every layer of a decode step passes the
        batch's one positions tensor, so the gathers run once per step, not once per layer."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        key = (positions.device, dtype)
        if key in self._reserved:
            cos, sin = self._tables[key]
        else:
            cos, sin = self._grow(key, int(positions.max()) + 1 if positions.numel() else 1)
        found = F.embedding(positions, cos), F.embedding(positions, sin)  # [b, s, hd]
        self._last = (positions, dtype, *found)      # one tuple: a reader on another thread sees all or none
        return found


def reserve_positions(family: object, n: int, device: torch.device, dtype: torch.dtype) -> None:
    """`RopeTable.reserve` for every RoPE table a family holds (as attributes; none for learned positions)."""
    for table in vars(family).values():
        if isinstance(table, RopeTable):
            table.reserve(n, device, dtype)


def rope_table(config: ModelConfig) -> RopeTable:
    """The RoPE table of `config` (rope_theta, rope_scaling incl. LongRoPE's two frequency sets)."""
    rope_type = (config.rope_scaling or {}).get("rope_type")
    if rope_type == "longrope":
        long_inv_freq, switch, mscale = _longrope(config)
        return RopeTable(rope_inv_freq(config), long_inv_freq, switch, mscale)
    if rope_type == "yarn":
        return RopeTable(rope_inv_freq(config), mscale=yarn_attention_factor(config))
    return RopeTable(rope_inv_freq(config))


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] with RoPE pairs interleaved (x0, x1), (x2, x3)... -> [..., d] as (x0, x2, ..., x1, x3, ...),
    the half-split layout `apply_rope` rotates (DeepSeek's `rope_interleave`; q and k get the same
    permutation, so their dot products are unchanged)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, n, s, hd], cos/sin [b, s, hd] -> x rotated (the half-split layout of Hugging Face Llama),
    contiguous on CUDA (`elementwise.rope`: one fused pass there, the torch ops elsewhere, the same bits)."""
    return rope(x, cos, sin)
