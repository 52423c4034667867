"""DeepseekV2ForCausalLM: multi-head latent attention (MLA) and DeepSeek's MoE, on the Llama family's embedding,
norms, dense MLP (the first `first_k_dense_replace` layers) and head, and Qwen-MoE's sparse block (its
`route` and `shared_experts` replaced).

MLA: q = q_b(RMSNorm(q_a x)) (or q_proj x without `q_lora_rank`), [kv latent | k_rot] = kv_a_proj_with_mqa x;
the latent (kv_lora_rank) is normed and up-projected by kv_b_proj into per-head k_nope and v; k_rot
(qk_rope_head_dim) carries RoPE and is shared by all heads. q_a_proj and kv_a_proj_with_mqa read the same
input, so they are one fused matrix (`PACKED`, data). RoPE runs over interleaved pairs (DeepSeek's layout,
`deinterleave`), with YaRN scaling where config.json says so (engine.models.layers.rope_table); the softmax
scale is `ModelConfig.attn_scale` (qk_head_dim ** -0.5 times YaRN's mscale_all_dim factor squared).

What the KV cache holds (the simplest correct choice, which the cache and the memory model already
understand): per head the full key [k_nope | k_rot] and value after up-projection, num_key_value_heads =
num_attention_heads, head_dim = max(qk_nope + qk_rope, v_head_dim); the value (or the key) is zero-padded to
head_dim, the attention output's padding is dropped before o_proj (a value's padded dims only ever reach
padded output dims). Caching the compressed latent (kv_lora_rank + qk_rope_head_dim per token, 9x smaller for
V2-Lite) would need its own cache layout: not done.

MoE (`deepseek_route`): router logits in float32, softmax (V2) or sigmoid (V3) scores, group-limited top-k
(the best `topk_group` of `n_group` groups: V2 ranks groups by their best score, V3 by the sum of their two
best scores plus `e_score_correction_bias`, which steers the choice but not the weights), the top-k weights
renormalised when `norm_topk_prob`, times `routed_scaling_factor`; routed experts through
`engine.models.moe.moe_experts` (Qwen2MoeFamily.mlp), plus `n_shared_experts` always-on experts (one ungated MLP of n x moe_intermediate_size).
transformers 5.24's V2 router ignores `norm_topk_prob` (every published V2 config sets it false); here it
renormalises as in V3.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from engine.models.base import LayerSpec, Weights, WeightSpec
from engine.models.config import ModelConfig
from engine.models.layers import apply_rope, deinterleave, linear, rms_norm, rope_table
from engine.models.qwen2_moe import Qwen2MoeFamily, routed_moe_weights


def deepseek_route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                   c: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, h], gate [E, h], bias [E] (V3's e_score_correction_bias) or None -> (weights [n, k] float32,
    experts [n, k] int64), as DeepSeek's router picks and weighs them (module docstring)."""
    logits = F.linear(x.float(), gate.float())                                   # [n, E]
    scores = logits.sigmoid() if c.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias.float()                   # [n, E]
    if c.topk_method != "greedy" and c.n_group > 1:
        n, E = choice.shape
        grouped = choice.view(n, c.n_group, E // c.n_group)                     # [n, G, E/G]
        if c.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)          # [n, G]
        else:
            group_scores = grouped.amax(dim=-1)                                 # [n, G]
        best = group_scores.topk(c.topk_group, dim=-1).indices                 # [n, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)   # [n, G]
        fill = float("-inf") if c.topk_method == "noaux_tc" else 0.0
        choice = grouped.masked_fill(~keep[..., None], fill).view(n, E)         # [n, E]
    top_e = choice.topk(c.num_experts_per_tok, dim=-1).indices                 # [n, k]
    top_w = scores.gather(1, top_e)                                              # [n, k]
    if c.norm_topk_prob:
        top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
    return top_w * c.routed_scaling_factor, top_e


class DeepseekV2Family(Qwen2MoeFamily):
    """MLA attention and DeepSeek's router and shared experts; embedding, dense MLP and head from Llama, the
    sparse block's flow (norm, route, routed experts, shared experts, residual) from Qwen-MoE (inherited)."""

    # fused weight -> the checkpoint's tensors under self_attn. (the query's first projection + kv_a)
    PACKED = {**Qwen2MoeFamily.PACKED, "q_kv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.rope = rope_table(replace(config, head_dim=config.qk_rope_head_dim))

    # ---- specs -------------------------------------------------------------------------------------
    def _q_width(self) -> int:
        """Output rows of the query's first projection: q_lora_rank, or every head's q without a q LoRA."""
        c = self.config
        return c.q_lora_rank or c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)

    def _attention_spec(self, i: int) -> LayerSpec:
        c = self.config
        p, h, nh = f"model.layers.{i}.self_attn.", c.hidden_size, c.num_attention_heads
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        first = self.PACKED["q_kv_a_proj"] if c.q_lora_rank else ("q_proj", "kv_a_proj_with_mqa")
        w = {
            "input_layernorm.weight": WeightSpec((h,), (f"model.layers.{i}.input_layernorm.weight",)),
            "q_kv_a_proj.weight": WeightSpec(                                   # [q | kv latent | k_rot, h]
                (self._q_width() + c.kv_lora_rank + c.qk_rope_head_dim, h),
                tuple(f"{p}{n}.weight" for n in first), quantizable=True),
            "kv_a_layernorm.weight": WeightSpec((c.kv_lora_rank,), (f"{p}kv_a_layernorm.weight",)),
            "kv_b_proj.weight": WeightSpec(                                     # [nh (nope + v), kv_lora_rank]
                (nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), (f"{p}kv_b_proj.weight",),
                quantizable=True),
            "o_proj.weight": WeightSpec((h, nh * c.v_head_dim), (f"{p}o_proj.weight",), quantizable=True),
        }
        if c.q_lora_rank:
            w["q_a_layernorm.weight"] = WeightSpec((c.q_lora_rank,), (f"{p}q_a_layernorm.weight",))
            w["q_b_proj.weight"] = WeightSpec((nh * qk, c.q_lora_rank), (f"{p}q_b_proj.weight",), quantizable=True)
        return LayerSpec(f"layers.{i}.self_attn", "attention", i, w)

    def _mlp_spec(self, i: int) -> LayerSpec:
        c = self.config
        if not c.is_moe_layer(i):
            return super()._mlp_spec(i)                       # dense: Llama's
        p, h, n, e = f"model.layers.{i}.mlp.", c.hidden_size, c.num_local_experts, c.expert_intermediate_size
        w = routed_moe_weights(c, i)
        if c.scoring_func == "sigmoid":
            w["gate.e_score_correction_bias"] = WeightSpec((n,), (f"{p}gate.e_score_correction_bias",))
        si = c.n_shared_experts * e
        if si:
            w["shared_experts.gate_up_proj.weight"] = WeightSpec(
                (2 * si, h), (f"{p}shared_experts.gate_proj.weight", f"{p}shared_experts.up_proj.weight"),
                quantizable=True)  # [2 si, h]
            w["shared_experts.down_proj.weight"] = WeightSpec(
                (h, si), (f"{p}shared_experts.down_proj.weight",), quantizable=True)  # [h, si]
        return LayerSpec(f"layers.{i}.mlp", "mlp", i, w)

    # ---- compute -----------------------------------------------------------------------------------
    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE over x [b, n, s, rope] (interleaved pairs when config.rope_interleave)."""
        return apply_rope(deinterleave(x) if self.config.rope_interleave else x, cos, sin)

    def attn_qkv(
        self, w: Weights, hidden: torch.Tensor, positions: torch.Tensor, layer: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        b, s, _ = hidden.shape
        nh, nope, rope, vd, hd = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                                  c.head_dim)
        x = rms_norm(hidden, w["input_layernorm.weight"], c.rms_norm_eps)                  # [b, s, h]
        q, latent, k_rot = linear(x, w["q_kv_a_proj.weight"]).split(
            [self._q_width(), c.kv_lora_rank, rope], dim=-1)                                # [b, s, .] x 3
        if c.q_lora_rank:
            q = linear(rms_norm(q, w["q_a_layernorm.weight"], c.rms_norm_eps), w["q_b_proj.weight"])
        q = q.view(b, s, nh, nope + rope).transpose(1, 2)                                   # [b, nh, s, qk]
        kv = linear(rms_norm(latent, w["kv_a_layernorm.weight"], c.rms_norm_eps), w["kv_b_proj.weight"])
        kv = kv.view(b, s, nh, nope + vd).transpose(1, 2)                                   # [b, nh, s, nope+v]
        cos, sin = self.rope.lookup(positions, hidden.dtype)                                # [b, s, rope]
        q_rot = self._rotate(q[..., nope:], cos, sin)                                       # [b, nh, s, rope]
        k_rot = self._rotate(k_rot.view(b, 1, s, rope), cos, sin)                           # [b, 1, s, rope]
        qk_pad = hd - nope - rope
        q = F.pad(torch.cat((q[..., :nope], q_rot), dim=-1), (0, qk_pad))                   # [b, nh, s, hd]
        k = F.pad(torch.cat((kv[..., :nope], k_rot.expand(b, nh, s, rope)), dim=-1), (0, qk_pad))
        v = F.pad(kv[..., nope:], (0, hd - vd))                                             # [b, nh, s, hd]
        return q, k, v

    def attn_out(self, w: Weights, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, s, _ = attn.shape
        out = attn.view(b, s, c.num_attention_heads, c.head_dim)[..., :c.v_head_dim]      # [b, s, nh, v]
        return residual + linear(out.reshape(b, s, -1), w["o_proj.weight"])                # [b, s, h]

    def route(self, w: Weights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return deepseek_route(x, w["gate.weight"], w.get("gate.e_score_correction_bias"), self.config)

    def shared_experts(self, w: Weights, x: torch.Tensor) -> torch.Tensor | None:
        """The n_shared_experts always-on experts (one ungated MLP) over x [n, h] -> [n, h]; None without."""
        if "shared_experts.down_proj.weight" not in w:
            return None
        gate, up = linear(x, w["shared_experts.gate_up_proj.weight"]).chunk(2, dim=-1)  # 2 x [n, si]
        return linear(self.act_mul(gate, up), w["shared_experts.down_proj.weight"])       # [n, h]
