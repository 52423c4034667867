"""Llama-shaped decoders: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (and SmolLM2, a Llama).

Grouped-query attention with RoPE (incl. "linear"/"llama3" scaling), RMSNorm, SwiGLU MLP, optional q/k/v
bias (Qwen2), optional tied embeddings, a sliding window (Mistral; applied by the runtime from
`ModelConfig.layer_window`). q/k/v and gate/up are fused at load time: `PACKED` says which checkpoint
tensors form each fused weight (data: Phi3's checkpoints hold them fused already).
Mixtral, Qwen3, Qwen-MoE, Gemma and Phi3 reuse the parts here they share (see their files).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.base import LayerSpec, Weights, WeightSpec
from engine.models.config import ModelConfig
from engine.models.elementwise import rope
from engine.models.layers import activation, apply_rope, gated_activation, linear, rms_norm, rope_table


class LlamaFamily:
    """Pure layer functions of the Llama family; holds only the config and the RoPE frequencies."""

    # fused weight -> the checkpoint's tensors (under self_attn. / mlp.) concatenated along dim 0
    PACKED: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                          "gate_up_proj": ("gate_proj", "up_proj")}
    # weights read only through `layers.linear`: a CPU run may hold them packed (`engine.models.cpu_linear`)
    LINEAR_WEIGHTS = frozenset({"qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight",
                                "lm_head.weight"})

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.rope = rope_table(config)
        self.act = activation(config.hidden_act)
        self.act_mul = gated_activation(config.hidden_act)  # (gate, up) -> act(gate) * up, fused for SiLU

    # ---- specs -------------------------------------------------------------------------------------
    def layer_specs(self) -> list[LayerSpec]:
        specs = [self._embed_spec()]
        for i in range(self.config.num_hidden_layers):
            specs.append(self._attention_spec(i))
            specs.append(self._mlp_spec(i))
        specs.append(self._head_spec())
        return specs

    def _embed_spec(self) -> LayerSpec:
        c = self.config
        w = {"embed_tokens.weight": WeightSpec((c.vocab_size, c.hidden_size), ("model.embed_tokens.weight",))}
        return LayerSpec("embed", "embed", -1, w)

    def _attention_spec(self, i: int) -> LayerSpec:
        c = self.config
        p = f"model.layers.{i}."
        q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        qkv = tuple(f"{p}self_attn.{n}" for n in self.PACKED["qkv_proj"])
        w = {
            "input_layernorm.weight": WeightSpec((c.hidden_size,), (f"{p}input_layernorm.weight",)),
            "qkv_proj.weight": WeightSpec(
                (q_out + 2 * kv_out, c.hidden_size), tuple(f"{n}.weight" for n in qkv), quantizable=True
            ),
            "o_proj.weight": WeightSpec((c.hidden_size, q_out), (f"{p}self_attn.o_proj.weight",), quantizable=True),
        }
        if c.attention_bias:
            w["qkv_proj.bias"] = WeightSpec((q_out + 2 * kv_out,), tuple(f"{n}.bias" for n in qkv))
        return LayerSpec(f"layers.{i}.self_attn", "attention", i, w)

    def _mlp_spec(self, i: int) -> LayerSpec:
        c = self.config
        p = f"model.layers.{i}."
        w = {
            "post_attention_layernorm.weight": WeightSpec((c.hidden_size,), (f"{p}post_attention_layernorm.weight",)),
            "gate_up_proj.weight": WeightSpec(
                (2 * c.intermediate_size, c.hidden_size),
                tuple(f"{p}mlp.{n}.weight" for n in self.PACKED["gate_up_proj"]), quantizable=True,
            ),
            "down_proj.weight": WeightSpec(
                (c.hidden_size, c.intermediate_size), (f"{p}mlp.down_proj.weight",), quantizable=True
            ),
        }
        return LayerSpec(f"layers.{i}.mlp", "mlp", i, w)

    def _head_spec(self) -> LayerSpec:
        c = self.config
        source = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        w = {
            "norm.weight": WeightSpec((c.hidden_size,), ("model.norm.weight",)),
            "lm_head.weight": WeightSpec((c.vocab_size, c.hidden_size), (source,)),
        }
        return LayerSpec("head", "head", -1, w)

    # ---- compute -----------------------------------------------------------------------------------
    def embed(self, w: Weights, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, w["embed_tokens.weight"])  # [b, s, h]

    def attn_qkv(
        self, w: Weights, hidden: torch.Tensor, positions: torch.Tensor, layer: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = rms_norm(hidden, w["input_layernorm.weight"], self.config.rms_norm_eps)  # [b, s, h]
        cos, sin = self.rope.lookup(positions, hidden.dtype)  # [b, s, hd]
        if not x.is_cuda:
            return self.qkv_rotated(w, x, cos, sin)
        q, k, v = self.qkv_heads(w, x)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()

    def qkv_rotated(self, w: Weights, x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`attn_qkv` after the norm, off CUDA: q and k rotated in one pass over their heads side by side in
        the projection's output (the same elementwise products as rotating each: the same bits) -> q [b, nh, s,
        hd], k/v [b, nkv, s, hd]."""
        c = self.config
        b, s, _ = x.shape
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv = linear(x, w["qkv_proj.weight"], w.get("qkv_proj.bias"))  # [b, s, (nh+2nkv)*hd]
        qk = rope(qkv[..., :(nh + nkv) * hd].view(b, s, nh + nkv, hd), cos, sin, head_dim=2)  # [b, s, nh+nkv, hd]
        v = qkv[..., (nh + nkv) * hd:].view(b, s, nkv, hd).transpose(1, 2).contiguous()  # [b, nkv, s, hd]
        return qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:].transpose(1, 2), v

    def qkv_heads(self, w: Weights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The normed hidden x [b, s, h] -> q [b, nh, s, hd], k/v [b, nkv, s, hd] before RoPE."""
        c = self.config
        b, s, _ = x.shape
        qkv = linear(x, w["qkv_proj.weight"], w.get("qkv_proj.bias"))  # [b, s, (nh+2nkv)*hd]
        q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        q, k, v = qkv.split([q_out, kv_out, kv_out], dim=-1)
        q = q.view(b, s, c.num_attention_heads, c.head_dim).transpose(1, 2)  # [b, nh, s, hd]
        k = k.view(b, s, c.num_key_value_heads, c.head_dim).transpose(1, 2)  # [b, nkv, s, hd]
        v = v.view(b, s, c.num_key_value_heads, c.head_dim).transpose(1, 2)  # [b, nkv, s, hd]
        return q, k, v

    def attn_out(self, w: Weights, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + linear(attn, w["o_proj.weight"])  # [b, s, h]

    def mlp(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        x = rms_norm(hidden, w["post_attention_layernorm.weight"], self.config.rms_norm_eps)  # [b, s, h]
        gate, up = linear(x, w["gate_up_proj.weight"]).chunk(2, dim=-1)  # 2 x [b, s, i]
        return hidden + linear(self.act_mul(gate, up), w["down_proj.weight"])  # [b, s, h]

    def head(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        x = rms_norm(hidden, w["norm.weight"], self.config.rms_norm_eps)  # [b, h]
        return linear(x, w["lm_head.weight"])  # [b, v]
