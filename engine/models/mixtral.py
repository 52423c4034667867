"""MixtralForCausalLM: the Llama family's embedding, attention and head, with a sparse-MoE MLP.

Experts are stacked tensors built from the per-expert checkpoint tensors (WeightSpec sources stacked):
w1 [E, i, h] (gate), w2 [E, h, i] (down), w3 [E, i, h] (up). Routing is transformers' MixtralTopKRouter:
softmax over E in float32, top-k, renormalised to sum 1. Each expert computes only the tokens routed to it,
in a few batched launches (`engine.models.moe`, shared with the Qwen-MoE and DeepSeek families).
"""
from __future__ import annotations

import torch

from engine.models.base import LayerSpec, Weights, WeightSpec
from engine.models.layers import rms_norm
from engine.models.llama import LlamaFamily
from engine.models.moe import moe_experts, moe_route


class MixtralFamily(LlamaFamily):
    """Llama attention and head (inherited), sparse-MoE MLP."""

    def _mlp_spec(self, i: int) -> LayerSpec:
        c = self.config
        p = f"model.layers.{i}."
        e = f"{p}block_sparse_moe.experts."
        n = c.num_local_experts

        def stacked(name: str, shape: tuple[int, int]) -> WeightSpec:
            return WeightSpec((n, *shape), tuple(f"{e}{j}.{name}.weight" for j in range(n)), quantizable=True)

        w = {
            "post_attention_layernorm.weight": WeightSpec((c.hidden_size,), (f"{p}post_attention_layernorm.weight",)),
            "gate.weight": WeightSpec((n, c.hidden_size), (f"{p}block_sparse_moe.gate.weight",)),
            "experts.w1": stacked("w1", (c.intermediate_size, c.hidden_size)),  # [E, i, h]
            "experts.w2": stacked("w2", (c.hidden_size, c.intermediate_size)),  # [E, h, i]
            "experts.w3": stacked("w3", (c.intermediate_size, c.hidden_size)),  # [E, i, h]
        }
        return LayerSpec(f"layers.{i}.block_sparse_moe", "mlp", i, w)

    def mlp(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden.shape
        x = rms_norm(hidden, w["post_attention_layernorm.weight"], self.config.rms_norm_eps).reshape(b * s, h)
        top_w, top_e = moe_route(x, w["gate.weight"], self.config.num_experts_per_tok)  # [n, k] x 2
        y = moe_experts(x, top_w, top_e, w["experts.w1"], w["experts.w2"], w["experts.w3"], self.act)  # [n, h]
        return hidden + y.view(b, s, h)
