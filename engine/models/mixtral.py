"""MixtralForCausalLM: the Llama family's embedding, attention and head, with a sparse-MoE MLP.

Experts are stacked tensors built from the per-expert checkpoint tensors (WeightSpec sources stacked):
w1 [E, i, h] (gate), w2 [E, h, i] (down), w3 [E, i, h] (up). Routing is transformers' MixtralTopKRouter:
softmax over E in float32, top-k, renormalised to sum 1. Each expert computes only the tokens routed to it.
`moe_route` / `moe_experts` are shared with the Qwen-MoE families (qwen2_moe.py).
"""
from __future__ import annotations

import torch

from engine.models.base import LayerSpec, Weights, WeightSpec
from engine.models.layers import linear, rms_norm
from engine.models.llama import LlamaFamily


def moe_route(x: torch.Tensor, gate: torch.Tensor, top_k: int,
              normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, h], gate [E, h] -> (weights [n, k] float32, experts [n, k] int64). The weights are the softmax
    probabilities of the chosen experts, renormalised to sum 1 per row when `normalize` (Mixtral; Qwen-MoE's
    `norm_topk_prob`)."""
    probs = torch.softmax(linear(x, gate).float(), dim=-1)  # [n, E]
    top_w, top_e = torch.topk(probs, top_k, dim=-1)  # [n, k]
    return (top_w / top_w.sum(dim=-1, keepdim=True) if normalize else top_w), top_e


def moe_experts(
    x: torch.Tensor, top_w: torch.Tensor, top_e: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
    w3: torch.Tensor, act,
) -> torch.Tensor:
    """Sum over each token's routed experts of weight * w2(act(w1 x) * w3 x). x [n, h] -> [n, h].

    One host sync per call (the per-expert counts), not one per expert: the (token, slot) pairs are sorted
    by expert once (stably, so each expert sees its tokens in ascending order, as `torch.where` lists them),
    so a GPU's launches are not serialized behind a sync per expert (MoE pipeline: the host thread keeps
    launching while host attention runs)."""
    out = torch.zeros_like(x)  # [n, h]
    k = top_e.shape[1]
    flat = top_e.flatten()  # [n*k]
    order = torch.sort(flat, stable=True).indices  # [n*k] grouped by expert
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    start = 0
    for e, count in enumerate(counts):
        pick, start = order[start:start + count], start + count  # [m] flat (token, slot) indices
        if count == 0:
            continue
        token, slot = pick // k, pick % k  # [m], [m]
        h = x[token]  # [m, h]
        y = linear(act(linear(h, w1[e])) * linear(h, w3[e]), w2[e])  # [m, h]
        out.index_add_(0, token, (y * top_w[token, slot, None]).to(out.dtype))
    return out


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
