"""Gemma3ForCausalLM (text-only, `Gemma3TextConfig`): Gemma2's layers plus a (1 + weight) RMSNorm over each
head's q and k before RoPE, and a local RoPE base (`rope_local_base_freq`, no scaling) on the sliding-window
layers while the global layers use rope_theta with rope_scaling. No soft-capping unless config.json sets it.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from engine.models.base import LayerSpec, Weights, WeightSpec
from engine.models.config import ModelConfig
from engine.models.gemma2 import Gemma2Family, gemma_rms_norm
from engine.models.layers import RopeTable, rope_table


class Gemma3Family(Gemma2Family):
    """Gemma2 (inherited) with q_norm / k_norm and per-layer-type RoPE."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        local = config.rope_local_base_freq
        self.local_rope = self.rope if local is None else rope_table(replace(config, rope_theta=local, rope_scaling=None))

    def _attention_spec(self, i: int) -> LayerSpec:
        spec = super()._attention_spec(i)
        hd, p = self.config.head_dim, f"model.layers.{i}.self_attn."
        norms = {f"{n}.weight": WeightSpec((hd,), (f"{p}{n}.weight",)) for n in ("q_norm", "k_norm")}
        return LayerSpec(spec.name, spec.kind, spec.index, {**spec.weights, **norms})

    def rope_for(self, layer: int) -> RopeTable:
        return self.local_rope if layer >= 0 and self.config.layer_window(layer) is not None else self.rope

    def qk_norm(self, w: Weights, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.config.rms_norm_eps
        return gemma_rms_norm(q, w["q_norm.weight"], eps), gemma_rms_norm(k, w["k_norm.weight"], eps)
