"""Gemma2ForCausalLM: Llama-shaped GQA + RoPE with Gemma's changes.

  - token embeddings times sqrt(hidden_size) (the constant cast to the weights' dtype first, as transformers);
  - RMSNorm with a (1 + weight) scale, computed wholly in float32 (`gemma_rms_norm`);
  - a norm after attention (post_attention_layernorm) and around the MLP (pre_/post_feedforward_layernorm);
  - GeGLU MLP (`hidden_activation`, gelu_pytorch_tanh);
  - attention scale query_pre_attn_scalar ** -0.5, attention-logit soft-capping, sliding-window layers
    interleaved with global ones: config data the runtime applies (ModelConfig.attn_scale,
    attn_logit_softcapping, layer_window);
  - final-logit soft-capping in the head. The lm_head is tied to the embedding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.base import LayerSpec, Weights, WeightSpec
from engine.models.layers import apply_rope, linear
from engine.models.llama import LlamaFamily


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight), all in float32, cast back to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap), or x when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


class Gemma2Family(LlamaFamily):
    """Llama's specs and projections (inherited) with Gemma's norms, embedding scale, GeGLU and head."""

    def _attention_spec(self, i: int) -> LayerSpec:
        spec = super()._attention_spec(i)
        name = "post_attention_layernorm.weight"
        post = WeightSpec((self.config.hidden_size,), (f"model.layers.{i}.{name}",))
        return LayerSpec(spec.name, spec.kind, spec.index, {**spec.weights, name: post})

    def _mlp_spec(self, i: int) -> LayerSpec:
        spec = super()._mlp_spec(i)
        h, p = self.config.hidden_size, f"model.layers.{i}."
        w = {k: v for k, v in spec.weights.items() if k != "post_attention_layernorm.weight"}
        for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            w[f"{name}.weight"] = WeightSpec((h,), (f"{p}{name}.weight",))
        return LayerSpec(spec.name, spec.kind, spec.index, w)

    def _norm(self, w: Weights, name: str, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, w[f"{name}.weight"], self.config.rms_norm_eps)

    def embed(self, w: Weights, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, w["embed_tokens.weight"])  # [b, s, h]
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)

    def rope_for(self, layer: int):
        """The RoPE table of decoder layer `layer` (one for every layer here; Gemma3 has a local one)."""
        return self.rope

    def qk_norm(self, w: Weights, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q/k normalisation before RoPE: none in Gemma2 (Gemma3 overrides)."""
        return q, k

    def attn_qkv(
        self, w: Weights, hidden: torch.Tensor, positions: torch.Tensor, layer: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_heads(w, self._norm(w, "input_layernorm", hidden))  # [b, nh|nkv, s, hd]
        q, k = self.qk_norm(w, q, k)
        cos, sin = self.rope_for(layer).lookup(positions, hidden.dtype)  # [b, s, hd]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()

    def attn_out(self, w: Weights, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + self._norm(w, "post_attention_layernorm", linear(attn, w["o_proj.weight"]))  # [b, s, h]

    def mlp(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        x = self._norm(w, "pre_feedforward_layernorm", hidden)  # [b, s, h]
        gate, up = linear(x, w["gate_up_proj.weight"]).chunk(2, dim=-1)  # 2 x [b, s, i]
        y = linear(self.act(gate) * up, w["down_proj.weight"])  # [b, s, h]
        return hidden + self._norm(w, "post_feedforward_layernorm", y)

    def head(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        x = self._norm(w, "norm", hidden)  # [b, h]
        return soft_cap(linear(x, w["lm_head.weight"]).float(), self.config.final_logit_softcapping)  # [b, v]
