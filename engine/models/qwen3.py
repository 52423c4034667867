"""Qwen3ForCausalLM: the Llama family with an RMSNorm over each head's q and k (before RoPE), head_dim from
config.json (Qwen3 decouples it from hidden_size / num_attention_heads), no q/k/v bias."""
from __future__ import annotations

import torch

from engine.models.base import LayerSpec, Weights, WeightSpec
from engine.models.layers import apply_rope, rms_norm
from engine.models.llama import LlamaFamily


class Qwen3Family(LlamaFamily):
    """Llama layers (inherited) with per-head q_norm / k_norm in attention."""

    def _attention_spec(self, i: int) -> LayerSpec:
        spec = super()._attention_spec(i)
        hd, p = self.config.head_dim, f"model.layers.{i}.self_attn."
        norms = {f"{n}.weight": WeightSpec((hd,), (f"{p}{n}.weight",)) for n in ("q_norm", "k_norm")}
        return LayerSpec(spec.name, spec.kind, spec.index, {**spec.weights, **norms})

    def attn_qkv(
        self, w: Weights, hidden: torch.Tensor, positions: torch.Tensor, layer: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        x = rms_norm(hidden, w["input_layernorm.weight"], c.rms_norm_eps)  # [b, s, h]
        q, k, v = self.qkv_heads(w, x)  # [b, nh|nkv, s, hd]
        q = rms_norm(q, w["q_norm.weight"], c.rms_norm_eps)  # per head, over hd
        k = rms_norm(k, w["k_norm.weight"], c.rms_norm_eps)
        cos, sin = self.rope.lookup(positions, hidden.dtype)  # [b, s, hd]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()
