"""`ModelConfig` from a Hugging Face config.json dict (transformers 4.x and 5.x spellings).

Normalises the differences between families (OPT's `ffn_dim`, `activation_function`; RoPE in
`rope_scaling` + `rope_theta` or in 5.x's `rope_parameters`; `eos_token_id` int or list) so that every
family reads one dataclass.
"""
from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.layers import SUPPORTED_ROPE_TYPES


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either spelling; rope_scaling always has a "rope_type" key."""
    params = dict(d.get("rope_parameters") or {})
    legacy = dict(d.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = d.get("rope_theta", 10000.0)
    scaling = params or legacy
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default")) if scaling else "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **scaling}


def _require(d: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if d.get(k) is None]
    if missing:
        raise ValueError(f"config.json: missing required field(s) {missing}")


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json. Raises ValueError naming a missing field."""
    archs = d.get("architectures") or []
    if not archs:
        raise ValueError("config.json: no `architectures` entry; cannot tell the model family")
    arch = archs[0]
    dtype = str(d.get("dtype") or d.get("torch_dtype") or "float32")
    tokens = dict(
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=_eos_tuple(d.get("eos_token_id")),
        pad_token_id=d.get("pad_token_id"),
        torch_dtype=dtype,
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
    theta, scaling = _rope(d)
    attention_bias = bool(d.get("attention_bias", False)) or arch == "Qwen2ForCausalLM"
    return ModelConfig(
        architecture=arch, vocab_size=d["vocab_size"], hidden_size=hidden,
        intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or hidden // heads,
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), attention_bias=attention_bias,
        hidden_act=d.get("hidden_act", "silu"),
        num_local_experts=d.get("num_local_experts", 0) or 0,
        num_experts_per_tok=d.get("num_experts_per_tok", 0) or 0, **tokens,
    )
