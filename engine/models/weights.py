"""`WeightSource`: where a layer's tensors come from (a checkpoint on disk, or dummy weights).

The runtime asks a source for one layer at a time (`get(spec)`), so models bigger than RAM stream from it.
Fusion rule for a `WeightSpec` with several sources (shared by every source):
  - if the spec has one more dim than each source and `shape[0] == len(sources)`: the sources are stacked
    (Mixtral experts: E tensors [i, h] -> [E, i, h]);
  - otherwise they are concatenated along dim 0 (fused q/k/v, gate/up).
`stored_quant` says in which 4-bit grouping (if any) the runtime holds a weight; a source of an int4
checkpoint also has `get_stored(spec)`, the layer's weights in that form (packed ones as `QTensor`s).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Protocol, Sequence

import torch

from engine.models.base import LayerSpec, WeightSpec
from engine.models.config import ModelConfig
from engine.quant.config import WEIGHT_QUANT, QuantConfig


class WeightSource(Protocol):
    """Supplies each layer's weights on the CPU in `dtype`.

    `get` returns fresh tensors (never views of a shared buffer the source will overwrite); it is safe to
    call from several threads at once. `nbytes` is the size `get` would return, without reading."""

    dtype: torch.dtype

    def get(self, spec: LayerSpec) -> dict[str, torch.Tensor]:
        """That layer's tensors by local name, fused per WeightSpec.sources, shaped per WeightSpec.shape."""

    def nbytes(self, spec: LayerSpec) -> int:
        """Bytes of `get(spec)`'s tensors in this source's dtype."""


def is_stacked(spec: WeightSpec) -> bool:
    """True when `spec`'s sources are stacked along a new dim 0 rather than concatenated."""
    return len(spec.sources) > 1 and spec.shape[0] == len(spec.sources) and len(spec.shape) >= 2


def expected_source_shapes(spec: WeightSpec, actual: Sequence[tuple[int, ...]]) -> str | None:
    """None when source tensors of shapes `actual` fuse into `spec.shape`; else a description of the mismatch."""
    if is_stacked(spec):
        want = tuple(spec.shape[1:])
        bad = [a for a in actual if tuple(a) != want]
        return None if not bad else f"each of {len(spec.sources)} stacked sources must be {list(want)}"
    if len(actual) == 1:
        return None if tuple(actual[0]) == tuple(spec.shape) else f"expected {list(spec.shape)}"
    if any(len(a) != len(spec.shape) or tuple(a[1:]) != tuple(spec.shape[1:]) for a in actual):
        return f"sources concatenated along dim 0 must have trailing dims {list(spec.shape[1:])}"
    if sum(a[0] for a in actual) != spec.shape[0]:
        return f"sources concatenated along dim 0 must sum to {spec.shape[0]} rows"
    return None


def fuse(spec: WeightSpec, parts: list[torch.Tensor]) -> torch.Tensor:
    """Fuse one WeightSpec's source tensors (already in the target dtype) into spec.shape."""
    if len(parts) == 1:
        return parts[0]
    if is_stacked(spec):
        return torch.stack(parts, dim=0)
    return torch.cat(parts, dim=0)


def layer_nbytes(spec: LayerSpec, dtype: torch.dtype) -> int:
    """Bytes of a layer's weights in `dtype`."""
    return spec.nbytes(torch.empty((), dtype=dtype).element_size())


def weight_quant(config: ModelConfig) -> QuantConfig:
    """The grouping compress_weights holds `config`'s quantizable weights in (`ModelConfig.weight_group_size`:
    WEIGHT_QUANT's 64 for a float checkpoint, GGUF_WEIGHT_QUANT's 32 for a GGUF)."""
    return replace(WEIGHT_QUANT, group_size=config.weight_group_size)


def stored_quant(config: ModelConfig, spec: WeightSpec, compress: QuantConfig | None) -> QuantConfig | None:
    """The 4-bit grouping the runtime holds weight `spec` in, None for dense: an int4 checkpoint's packed
    weights keep the checkpoint's groups whatever `compress` says (they are 4-bit already; nothing is
    re-quantized); other quantizable weights take `compress` (the policy's compress_weights); the rest
    (embeddings, norms, the head) stay dense."""
    if not spec.quantizable:
        return None
    q = config.quantization_config
    if q is not None and q.packs(spec.sources):
        return q.quant_for(spec.shape[-1])
    return compress
