"""`ModelConfig` from a Hugging Face config.json dict (transformers 4.x and 5.x spellings).

Normalises the differences between families (OPT's `ffn_dim`, `activation_function`; RoPE in
`rope_scaling` + `rope_theta` or in 5.x's `rope_parameters`, Gemma3's per-layer-type rope_parameters or 4.x's
`rope_local_base_freq`; Phi3's "su" rope = "longrope"; sliding windows as `layer_types`, Gemma's
`sliding_window_pattern`, Qwen2's `use_sliding_window` + `max_window_layers`; Qwen-MoE's `num_experts`;
`eos_token_id` int or list; DeepSeek's MLA and MoE fields) so that every family reads one dataclass.
Pre-quantized checkpoints other than AWQ / GPTQ (`quantization_config`: bitsandbytes, FP8, ...) are refused
with an error naming the method.
"""
from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.int4_config import Int4Config
from engine.models.layers import SUPPORTED_ROPE_TYPES


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(d: dict[str, Any], params: dict[str, Any] | None = None) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either spelling; rope_scaling always has a "rope_type" key."""
    params = dict((d.get("rope_parameters") or {}) if params is None else params)
    legacy = dict(d.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = d.get("rope_theta", 10000.0)
    partial = float(params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise ValueError(f"config.json: partial_rotary_factor {partial} is not supported (only 1.0)")
    scaling = params or legacy
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default")) if scaling else "default"
    rope_type = "longrope" if rope_type == "su" else rope_type
    if rope_type == "longrope" and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = d.get("original_max_position_embeddings")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **scaling}


def _rope_by_layer_type(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float | None]:
    """(rope_theta, rope_scaling, rope_local_base_freq): Gemma3's global and sliding-layer RoPE, 5.x's
    {"full_attention": ..., "sliding_attention": ...} or 4.x's rope_theta / rope_scaling / rope_local_base_freq."""
    params = d.get("rope_parameters") or {}
    if "full_attention" in params:
        theta, scaling = _rope(d, params["full_attention"])
        local = params.get("sliding_attention", {}).get("rope_theta")
        return theta, scaling, None if local is None else float(local)
    theta, scaling = _rope(d)
    local = d.get("rope_local_base_freq")
    return theta, scaling, None if local is None else float(local)


_WINDOW_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}   # every n-th layer is global


def _sliding(d: dict[str, Any], arch: str) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types): the window and which layers use it; (None, ()) when none does."""
    window = d.get("sliding_window")
    if not window or d.get("use_sliding_window", True) is False:
        return None, ()
    types = d.get("layer_types")
    n = d["num_hidden_layers"]
    if types is None and arch in _WINDOW_PATTERN:
        every = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or _WINDOW_PATTERN[arch]
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    elif types is None and d.get("use_sliding_window") and d.get("max_window_layers") is not None:
        types = ["sliding_attention" if i >= d["max_window_layers"] else "full_attention" for i in range(n)]
    elif types is None:
        return int(window), ()                     # every layer (Mistral, Phi3)
    types = tuple(types)
    if len(types) != n:
        raise ValueError(f"config.json: layer_types has {len(types)} entries for {n} layers")
    return (int(window), types) if "sliding_attention" in types else (None, ())


_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_TOPK_METHODS = {"DeepseekV2ForCausalLM": ("greedy", "group_limited_greedy"), "DeepseekV3ForCausalLM": ("noaux_tc",)}


def _deepseek(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig fields of a DeepSeek-V2/V3 config.json: MLA shapes (the cache's head_dim is
    max(qk_nope + qk_rope, v_head_dim), one kv head per query head), shared experts, dense first layers,
    routing (V2: softmax scores, `topk_method` greedy or group-limited; V3: sigmoid scores with a correction
    bias, groups ranked by their top-2 sum)."""
    _require(d, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError(f"config.json: {arch} with attention_bias / mlp_bias is not supported")
    v3 = arch == "DeepseekV3ForCausalLM"
    method = "noaux_tc" if v3 else (d.get("topk_method") or "greedy")
    if method not in _TOPK_METHODS[arch]:
        raise ValueError(f"config.json: topk_method {method!r} is not supported for {arch}; "
                         f"supported: {list(_TOPK_METHODS[arch])}")
    scoring = d.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ValueError(f"config.json: scoring_func {scoring!r} is not supported for {arch}")
    nope, rope, v = int(d["qk_nope_head_dim"]), int(d["qk_rope_head_dim"]), int(d["v_head_dim"])
    experts = int(d.get("n_routed_experts") or 0)
    n_group = int(d.get("n_group") or 1)
    if experts and experts % n_group:
        raise ValueError(f"config.json: n_routed_experts {experts} is not a multiple of n_group {n_group}")
    return dict(
        head_dim=max(nope + rope, v), num_key_value_heads=d["num_attention_heads"],
        q_lora_rank=d.get("q_lora_rank") or None, kv_lora_rank=int(d["kv_lora_rank"]), qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=v, rope_interleave=bool(d.get("rope_interleave", True)) if v3 else True,
        num_local_experts=experts, n_shared_experts=int(d.get("n_shared_experts") or 0),
        first_k_dense_replace=int(d.get("first_k_dense_replace") or 0), moe_layer_freq=int(d.get("moe_layer_freq") or 1),
        scoring_func=scoring, topk_method=method, n_group=n_group, topk_group=int(d.get("topk_group") or 1),
        routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0) if v3 else 0,
    )


def _require(d: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if d.get(k) is None]
    if missing:
        raise ValueError(f"config.json: missing required field(s) {missing}")


def _refuse_prequantized(d: dict[str, Any]) -> None:
    """Pre-quantized checkpoints other than AWQ / GPTQ (bitsandbytes, FP8, ...: `quantization_config` in
    config.json) hold tensors no source here reads: refuse them by name. AWQ / GPTQ int4 load through
    engine.models.int4_source, which validates their settings."""
    q = d.get("quantization_config")
    if not q:
        return
    method = q.get("quant_method", "unknown") if isinstance(q, dict) else "unknown"
    if str(method).lower() in ("awq", "gptq"):
        return
    detail = ", ".join(f"{k}={q[k]}" for k in ("bits", "group_size", "version", "desc_act", "sym")
                       if isinstance(q, dict) and k in q)
    raise ValueError(
        f"config.json: pre-quantized checkpoint (quantization_config quant_method={method!r}"
        f"{', ' + detail if detail else ''}) is not supported: only AWQ and GPTQ int4 tensors are loaded. "
        "Use the original float checkpoint (with compress_weights=True for 4-bit weights) or a GGUF file")


def _int4(d: dict[str, Any]) -> Int4Config | None:
    """An AWQ / GPTQ checkpoint's validated quantization_config (None for float weights)."""
    q = d.get("quantization_config")
    return Int4Config.from_hf(q) if q else None


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json. Raises ValueError naming a missing field, or naming the
    method of a pre-quantized checkpoint other than AWQ / GPTQ, which is not supported."""
    archs = d.get("architectures") or []
    if not archs:
        raise ValueError("config.json: no `architectures` entry; cannot tell the model family")
    _refuse_prequantized(d)
    arch = archs[0]
    dtype = str(d.get("dtype") or d.get("torch_dtype") or "float32")
    tokens = dict(
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=_eos_tuple(d.get("eos_token_id")),
        pad_token_id=d.get("pad_token_id"),
        torch_dtype=dtype,
        quantization_config=_int4(d),
    )
    if arch == "OPTForCausalLM":
        _require(d, "vocab_size", "hidden_size", "ffn_dim", "num_hidden_layers", "num_attention_heads")
        hidden, heads = d["hidden_size"], d["num_attention_heads"]
        return ModelConfig(
            architecture=arch, vocab_size=d["vocab_size"], hidden_size=hidden, intermediate_size=d["ffn_dim"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads, num_key_value_heads=heads,
            head_dim=hidden // heads, max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=1e-5, tie_word_embeddings=d.get("tie_word_embeddings", True),
            hidden_act=d.get("activation_function", "relu"),
            do_layer_norm_before=d.get("do_layer_norm_before", True),
            word_embed_proj_dim=d.get("word_embed_proj_dim") or hidden,
            enable_bias=d.get("enable_bias", True), **tokens,
        )
    _require(d, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    theta, scaling, local_theta = _rope_by_layer_type(d)
    qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
    attention_bias = bool(d.get("attention_bias", False)) or bool(d.get("qkv_bias", qwen2))
    window, layer_types = _sliding(d, arch)
    gemma = arch.startswith("Gemma")
    if (scaling or {}).get("rope_type") == "yarn" and arch not in _DEEPSEEK:
        raise ValueError(f"config.json: rope type 'yarn' is supported for {list(_DEEPSEEK)} only, not {arch}")
    extra = _deepseek(d, arch) if arch in _DEEPSEEK else {}
    base = dict(
        num_key_value_heads=d.get("num_key_value_heads") or heads, head_dim=d.get("head_dim") or hidden // heads,
        num_local_experts=d.get("num_local_experts") or d.get("num_experts") or 0,
        norm_topk_prob=arch == "MixtralForCausalLM" or bool(d.get("norm_topk_prob", False)),
    )
    return ModelConfig(
        architecture=arch, vocab_size=d["vocab_size"], hidden_size=hidden,
        intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads, max_position_embeddings=d.get("max_position_embeddings", 4096),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), attention_bias=attention_bias,
        hidden_act=(gemma and d.get("hidden_activation")) or d.get("hidden_act", "silu"),
        sliding_window=window, layer_types=layer_types,
        attn_logit_softcapping=d.get("attn_logit_softcapping") if gemma else None,
        final_logit_softcapping=d.get("final_logit_softcapping") if gemma else None,
        query_pre_attn_scalar=d.get("query_pre_attn_scalar") if gemma else None,
        rope_local_base_freq=local_theta if gemma else None,
        num_experts_per_tok=d.get("num_experts_per_tok", 0) or 0,
        moe_intermediate_size=d.get("moe_intermediate_size") or 0,
        shared_expert_intermediate_size=d.get("shared_expert_intermediate_size") or 0,
        decoder_sparse_step=d.get("decoder_sparse_step") or 1,
        mlp_only_layers=tuple(d.get("mlp_only_layers") or ()), **{**base, **extra}, **tokens,
    )
