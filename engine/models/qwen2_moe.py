"""Qwen2MoeForCausalLM: the Llama family's attention (q/k/v bias) and head, with Qwen's sparse-MoE MLP.

The MoE block reuses Mixtral's machinery (engine.models.moe: stacked experts w1/w2/w3 [E, ...], the
top-k router, the routed tokens' grouped compute), with Qwen's differences as config data:
`norm_topk_prob` (renormalise the top-k weights or keep the softmax values), `moe_intermediate_size` (each
expert's width), a shared expert of `shared_expert_intermediate_size` gated per token by
sigmoid(shared_expert_gate x), and dense MLP layers where `ModelConfig.is_moe_layer` says so
(`decoder_sparse_step`, `mlp_only_layers`).
"""
from __future__ import annotations

import torch

from engine.models.base import LayerSpec, Weights, WeightSpec
from engine.models.config import ModelConfig
from engine.models.layers import linear, rms_norm
from engine.models.llama import LlamaFamily
from engine.models.moe import moe_experts, moe_route


def routed_moe_weights(c: ModelConfig, i: int) -> dict[str, WeightSpec]:
    """Decoder layer i's norm, router and stacked routed experts under `model.layers.{i}.mlp.` (the Qwen-MoE
    and DeepSeek checkpoint names): w1 / w3 [E, e, h] from experts.{j}.gate_proj / up_proj, w2 [E, h, e]."""
    p = f"model.layers.{i}.mlp."
    h, n, e = c.hidden_size, c.num_local_experts, c.expert_intermediate_size

    def stacked(name: str, shape: tuple[int, int]) -> WeightSpec:
        return WeightSpec((n, *shape), tuple(f"{p}experts.{j}.{name}.weight" for j in range(n)), quantizable=True)

    return {
        "post_attention_layernorm.weight": WeightSpec((h,), (f"model.layers.{i}.post_attention_layernorm.weight",)),
        "gate.weight": WeightSpec((n, h), (f"{p}gate.weight",)),
        "experts.w1": stacked("gate_proj", (e, h)),  # [E, e, h]
        "experts.w2": stacked("down_proj", (h, e)),  # [E, h, e]
        "experts.w3": stacked("up_proj", (e, h)),  # [E, e, h]
    }


class Qwen2MoeFamily(LlamaFamily):
    """Llama attention and head (inherited), Qwen sparse-MoE MLP (or a dense one on non-sparse layers)."""

    def _mlp_spec(self, i: int) -> LayerSpec:
        c = self.config
        if not c.is_moe_layer(i):
            return super()._mlp_spec(i)
        p, h = f"model.layers.{i}.mlp.", c.hidden_size
        w = routed_moe_weights(c, i)
        si = c.shared_expert_intermediate_size
        if si:
            w["shared_expert.gate_up_proj.weight"] = WeightSpec(
                (2 * si, h), (f"{p}shared_expert.gate_proj.weight", f"{p}shared_expert.up_proj.weight"), quantizable=True
            )  # [2 si, h]
            w["shared_expert.down_proj.weight"] = WeightSpec(
                (h, si), (f"{p}shared_expert.down_proj.weight",), quantizable=True
            )  # [h, si]
            w["shared_expert_gate.weight"] = WeightSpec((1, h), (f"{p}shared_expert_gate.weight",))
        return LayerSpec(f"layers.{i}.mlp", "mlp", i, w)

    def mlp(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        if "gate.weight" not in w:
            return super().mlp(w, hidden)
        c = self.config
        b, s, h = hidden.shape
        x = rms_norm(hidden, w["post_attention_layernorm.weight"], c.rms_norm_eps).reshape(b * s, h)  # [n, h]
        top_w, top_e = self.route(w, x)                                                # [n, k] x 2
        y = moe_experts(x, top_w, top_e, w["experts.w1"], w["experts.w2"], w["experts.w3"], self.act)  # [n, h]
        shared = self.shared_experts(w, x)
        return hidden + (y if shared is None else y + shared).view(b, s, h)

    def route(self, w: Weights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, h] -> (weights [n, k] float32, experts [n, k]): softmax top-k, renormalised per norm_topk_prob."""
        return moe_route(x, w["gate.weight"], self.config.num_experts_per_tok, self.config.norm_topk_prob)

    def shared_experts(self, w: Weights, x: torch.Tensor) -> torch.Tensor | None:
        """The always-on expert's output [n, h] for x [n, h], gated per token by sigmoid(shared_expert_gate x);
        None without one."""
        if "shared_expert_gate.weight" not in w:
            return None
        gate, up = linear(x, w["shared_expert.gate_up_proj.weight"]).chunk(2, dim=-1)  # 2 x [n, si]
        shared = linear(self.act_mul(gate, up), w["shared_expert.down_proj.weight"])  # [n, h]
        return torch.sigmoid(linear(x, w["shared_expert_gate.weight"])) * shared
