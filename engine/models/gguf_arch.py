"""GGUF architectures as data: llama.cpp's tensor names and metadata keys -> Hugging Face names and config.json.

One `GGUFArch` per supported `general.architecture`: the HF `architectures` string it becomes, the per-block
tensor names (llama.cpp's `blk.N.<name>` -> HF's `model.layers.N.<name>`), whether llama.cpp's converter
permuted the q/k rows (only `llama`: its rotary layout is interleaved, every other one here is NEOX-style)
and whether norm weights are stored as `1 + w` (Gemma2/3: llama.cpp's converter adds the 1 that HF's
Gemma RMSNorm applies at run time; we subtract it at load, so the Gemma families compute as from HF).
`hf_config` builds a config.json dict from the metadata keys (`{arch}.embedding_length`, ...) and the few
tensors that are config rather than weights (`rope_freqs`: Llama-3.1's per-frequency RoPE divisors;
`rope_factors_long` / `rope_factors_short`: Phi3's LongRoPE factors).

Stacked MoE experts (`ffn_{gate,up,down}_exps`, [E, rows, cols]) are one GGUF tensor each: `EXPERT_NAMES`
names the per-expert HF tensor each slice becomes; the conversion's index points every expert at its own
byte range (quantized blocks run along rows, so each expert's rows are contiguous bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

_ATTN = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_MLP = {
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_MOE = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# stacked GGUF expert tensor -> the HF name of expert {j}'s slice
EXPERT_NAMES = {
    "ffn_gate_exps.weight": "mlp.experts.{j}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{j}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{j}.down_proj.weight",
}
_GEMMA_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_PHI3 = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",   # llama.cpp's phi3 ffn_up is HF's fused [gate; up]
    "ffn_down.weight": "mlp.down_proj.weight",
}
_DEEPSEEK2 = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",                  # without a q LoRA (V2-Lite)
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    **_MLP,
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",      # V3's router bias
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# tensors that are config, not weights: read into config.json's rope_scaling at conversion
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class GGUFArch:
    """How one llama.cpp architecture maps onto a Hugging Face family."""

    hf_architecture: str
    model_type: str
    layer_names: dict[str, str] = field(default_factory=dict)   # per block: GGUF name -> HF name
    permute_qk: bool = False      # llama.cpp's converter permuted q/k rows (llama's interleaved RoPE)
    norm_offset: float = 0.0      # stored norm weight = HF weight + norm_offset (Gemma: 1)


ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", "llama", {**_ATTN, **_MLP}, permute_qk=True),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "qwen2", {**_ATTN, **_MLP}),
    "qwen3": GGUFArch("Qwen3ForCausalLM", "qwen3", {**_ATTN, **_QK_NORM, **_MLP}),
    "qwen2moe": GGUFArch("Qwen2MoeForCausalLM", "qwen2_moe", {**_ATTN, **_MLP, **_MOE}),
    "qwen3moe": GGUFArch("Qwen3MoeForCausalLM", "qwen3_moe", {**_ATTN, **_QK_NORM, **_MLP, **_MOE}),
    "gemma2": GGUFArch("Gemma2ForCausalLM", "gemma2", {**_ATTN, **_MLP, **_GEMMA_NORMS}, norm_offset=1.0),
    "gemma3": GGUFArch("Gemma3ForCausalLM", "gemma3_text", {**_ATTN, **_QK_NORM, **_MLP, **_GEMMA_NORMS},
                       norm_offset=1.0),
    "phi3": GGUFArch("Phi3ForCausalLM", "phi3", _PHI3),
    # DeepSeek-V2/V3 (V3 when the router has exp_probs_b); RoPE interleaved as in HF, so nothing permuted
    "deepseek2": GGUFArch("DeepseekV2ForCausalLM", "deepseek_v2", _DEEPSEEK2),
}

_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}     # llama.cpp's hard-coded patterns: every n-th layer is global
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales 27B's queries by hidden/heads, not head_dim


def _layer_types(arch: str, n: int, pattern: Any) -> list[str]:
    """Per-layer "sliding_attention" / "full_attention" from `{arch}.attention.sliding_window_pattern` (an
    int period or a per-layer bool array, True = sliding) or llama.cpp's fixed pattern of the architecture."""
    if isinstance(pattern, (list, tuple)):
        return ["sliding_attention" if bool(p) else "full_attention" for p in pattern]
    every = int(pattern) if pattern else _SWA_PATTERN[arch]
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]


def _rope_scaling(arch: str, a: Callable[..., Any], tensor: Callable[[str], list[float] | None]
                  ) -> dict[str, Any] | None:
    """config.json's rope_scaling from the `rope.scaling.*` keys and the RoPE factor tensors."""
    long, short = tensor("rope_factors_long.weight"), tensor("rope_factors_short.weight")
    if long is not None and short is not None:                       # Phi3 LongRoPE
        out: dict[str, Any] = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                               "original_max_position_embeddings": int(a("rope.scaling.original_context_length"))}
        if a("rope.scaling.attn_factor") is not None:
            out["attention_factor"] = float(a("rope.scaling.attn_factor"))
        return out
    freqs = tensor("rope_freqs.weight")
    if freqs is not None:                                             # Llama 3.1: inv_freq / rope_freqs
        return {"rope_type": "freq_factors", "freq_factors": freqs}
    kind = a("rope.scaling.type")
    if kind in (None, "none") or (kind == "yarn" and arch == "deepseek2"):   # deepseek2: `_deepseek2`
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    raise ValueError(f"GGUF rope scaling {kind!r} ({arch}) is not supported; supported: none, linear, "
                     "Llama-3.1 rope_freqs, Phi3 LongRoPE factors")


def _deepseek2(a: Callable[..., Any], names: set[str], d: dict[str, Any]) -> dict[str, Any]:
    """config.json fields of a `deepseek2` GGUF: MLA ranks and head dims, dense first layers, shared experts,
    routing (llama.cpp's expert_gating_func 2 = sigmoid: V3, with exp_probs_b), YaRN. llama.cpp's newer
    converter splits kv_b into attn_k_b / attn_v_b (its absorbed-MLA layout): refused, naming the tensor."""
    if "blk.0.attn_k_b.weight" in names:
        raise ValueError("GGUF deepseek2 with attn_k_b / attn_v_b (llama.cpp's split kv_b, absorbed MLA) is not "
                         "supported; a file with attn_kv_b is")
    v3 = int(a("expert_gating_func") or 1) == 2 or any(n.endswith("exp_probs_b.bias") for n in names)
    rope, heads = int(a("rope.dimension_count")), d["num_attention_heads"]
    out = dict(
        architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        model_type="deepseek_v3" if v3 else "deepseek_v2", num_key_value_heads=heads,
        q_lora_rank=int(a("attention.q_lora_rank") or 0) or None, kv_lora_rank=int(a("attention.kv_lora_rank")),
        qk_rope_head_dim=rope, qk_nope_head_dim=int(a("attention.key_length")) - rope,
        v_head_dim=int(a("attention.value_length")), first_k_dense_replace=int(a("leading_dense_block_count", 0)),
        n_routed_experts=int(a("expert_count", 0)), num_experts=int(a("expert_count", 0)),
        num_experts_per_tok=int(a("expert_used_count", 0)), moe_intermediate_size=int(a("expert_feed_forward_length", 0)),
        n_shared_experts=int(a("expert_shared_count", 0)), routed_scaling_factor=float(a("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(a("expert_weights_norm", False)), n_group=int(a("expert_group_count", 1)),
        topk_group=int(a("expert_group_used_count", 1)), rope_interleave=True,
    )
    out["topk_method"] = "noaux_tc" if v3 else ("group_limited_greedy" if out["n_group"] > 1 else "greedy")
    if a("rope.scaling.type") == "yarn":
        m_all = float(a("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1    # llama.cpp stores 0.1 * mscale_all_dim
        out["rope_scaling"] = {"rope_type": "yarn", "factor": float(a("rope.scaling.factor")),
                               "original_max_position_embeddings": int(a("rope.scaling.original_context_length")),
                               "mscale": m_all, "mscale_all_dim": m_all,
                               "beta_fast": float(a("rope.scaling.yarn_beta_fast", 32.0)),
                               "beta_slow": float(a("rope.scaling.yarn_beta_slow", 1.0))}
    return out


def hf_config(arch: str, meta: Callable[[str], Any], names: set[str], shapes: dict[str, list[int]],
              tensor: Callable[[str], list[float] | None]) -> dict[str, Any]:
    """A config.json dict for the GGUF of architecture `arch`: `meta(key)` reads a metadata value (None when
    absent), `names` / `shapes` are its tensors (HF order, outermost dim first), `tensor(name)` reads a small
    float tensor (None when absent)."""
    spec = ARCHS[arch]

    def a(key: str, default: Any = None) -> Any:
        v = meta(f"{arch}.{key}")
        return default if v is None else v

    if arch == "llama" and a("expert_count"):
        raise ValueError("GGUF: a `llama` file with experts (Mixtral) is not supported from GGUF; load its "
                         "Hugging Face folder (MixtralForCausalLM)")
    hidden, heads = int(a("embedding_length")), int(a("attention.head_count"))
    head_dim = int(a("attention.key_length") or hidden // heads)
    n = int(a("block_count"))
    d: dict[str, Any] = {
        "architectures": [spec.hf_architecture], "model_type": spec.model_type,
        "vocab_size": int(shapes["token_embd.weight"][0]), "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length") or a("expert_feed_forward_length") or 0),
        "num_hidden_layers": n, "num_attention_heads": heads,
        "num_key_value_heads": int(a("attention.head_count_kv", heads)), "head_dim": head_dim,
        "max_position_embeddings": int(a("context_length", 4096)),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(a("rope.freq_base", 10000.0)), "rope_scaling": _rope_scaling(arch, a, tensor),
        "tie_word_embeddings": "output.weight" not in names, "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in names, "qkv_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": meta("tokenizer.ggml.bos_token_id"), "eos_token_id": meta("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta("tokenizer.ggml.padding_token_id"), "torch_dtype": "float32",
    }
    if arch == "deepseek2":
        return {**d, **_deepseek2(a, names, d)}
    rope_dims = a("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        d["partial_rotary_factor"] = int(rope_dims) / head_dim       # refused by hf_config, with the reason
    window = a("attention.sliding_window")
    if arch == "phi3" and window:
        d["sliding_window"] = int(window)                            # every layer, as transformers' Phi3
    if arch in _SWA_PATTERN:
        d.update(hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                 attn_logit_softcapping=a("attn_logit_softcapping"),
                 final_logit_softcapping=a("final_logit_softcapping"),
                 query_pre_attn_scalar=hidden // heads if n == _GEMMA_27B_LAYERS[arch] else head_dim)
        if window:
            d["sliding_window"] = int(window)
            d["layer_types"] = _layer_types(arch, n, a("attention.sliding_window_pattern"))
        if arch == "gemma3":
            d["rope_local_base_freq"] = float(a("rope.freq_base_swa", 10000.0))  # llama.cpp's default
    if a("expert_count"):
        shexp = shapes.get("blk.0.ffn_gate_shexp.weight")
        d.update(num_experts=int(a("expert_count")), num_experts_per_tok=int(a("expert_used_count")),
                 moe_intermediate_size=int(a("expert_feed_forward_length") or d["intermediate_size"]),
                 shared_expert_intermediate_size=int(a("expert_shared_feed_forward_length")
                                                     or (shexp[0] if shexp else 0)),
                 # llama.cpp: qwen2moe keeps the softmax weights, qwen3moe renormalises the top k
                 norm_topk_prob=bool(a("expert_weights_norm", arch == "qwen3moe")),
                 mlp_only_layers=[i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in names])
    return d
