"""The contract between a model family and the runtime.

A model is a sequence of layers in FlexGen's sense (j indexes them): one `embed`, then per decoder layer
one `attention` and one `mlp`, then one `head`. Each `LayerSpec` declares the weights it needs (names,
shapes, where they come from in the Hugging Face checkpoint); the family object supplies pure functions
that compute a layer from a dict of those weights. Placement, caching and scheduling belong to the
runtime, never to a family: a family function receives tensors already on the compute device.

Attention is split so that the runtime can run the cache-touching core wherever the cache lives
(FlexGen's CPU delegation): `attn_qkv` (projections + RoPE) -> runtime attention core over the KV cache
-> `attn_out` (output projection + residual).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from engine.models.config import ModelConfig

LayerKind = Literal["embed", "attention", "mlp", "head"]


@dataclass(frozen=True)
class WeightSpec:
    """One weight tensor of a layer.

    `sources` are the checkpoint's tensor names concatenated along dim 0 to form this tensor (one name for
    plain weights, several for a fused q/k/v or gate/up); `shape` is the shape after fusion. When `shape`
    has one more dim than each source and `shape[0] == len(sources)`, the sources are stacked instead
    (MoE experts: E tensors [i, h] -> [E, i, h]); see engine.models.weights.fuse.
    `quantizable` is True for the decoder layers' matmul weights, which 4-bit compression may group along
    the input dim. The output head stays dense in every family: 4 bits on SmolLM2's head alone cost +4.8%
    perplexity (its GGUF keeps the head at 8 bits), and with it dense 4-bit weights + cache measured +3.2%
    (benchmarks/accuracy/quant_perplexity.py).
    """

    shape: tuple[int, ...]
    sources: tuple[str, ...]
    quantizable: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class LayerSpec:
    """Layer j of the model: its kind, decoder index (-1 for embed/head) and weights by local name."""

    name: str
    kind: LayerKind
    index: int
    weights: dict[str, WeightSpec] = field(default_factory=dict)

    def nbytes(self, bytes_per_element: int) -> int:
        return sum(w.numel for w in self.weights.values()) * bytes_per_element


Weights = dict[str, torch.Tensor]


class ModelFamily(Protocol):
    """Pure layer functions of one architecture family. Shapes: b batch, s new tokens, h hidden_size,
    nh attention heads, nkv key/value heads, hd head_dim, v vocab."""

    config: ModelConfig

    def layer_specs(self) -> list[LayerSpec]:
        """Every layer in execution order (embed, [attention, mlp] x num_hidden_layers, head)."""

    def embed(self, w: Weights, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [b, s] int64 (position 0 = first real token) -> hidden [b, s, h]."""

    def attn_qkv(
        self, w: Weights, hidden: torch.Tensor, positions: torch.Tensor, layer: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [b, s, h] of decoder layer `layer` -> q [b, nh, s, hd], k [b, nkv, s, hd], v [b, nkv, s, hd],
        RoPE applied (`layer` picks per-layer RoPE, Gemma3's local base; -1 = unknown, the global one).

        q is pre-scaled by nothing: the attention core applies `config.attn_scale`, masks keys outside
        `config.layer_window(layer)` and soft-caps scores by `config.attn_logit_softcapping`."""

    def attn_out(self, w: Weights, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn [b, s, nh*hd], residual = the hidden that entered attn_qkv [b, s, h] -> hidden [b, s, h]."""

    def mlp(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [b, s, h] -> hidden [b, s, h] (norm, MLP or sparse-MoE block, residual)."""

    def head(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [b, h] (last position only) -> logits [b, v] in hidden's dtype (float32 where the head computes in
        it: Gemma2's soft-capping). Selection reads them as they are: a bfloat16 or float16 value converts to
        float32 exactly, so greedy picks the same token and sampling widens them first."""
