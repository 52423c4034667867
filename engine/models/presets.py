"""Named model shapes for dummy-weight runs (benchmarks, as the FlexGen paper did) and tests.

Data only: each preset is a Hugging Face config.json dict, turned into a ModelConfig by `config_from_hf`.
The real models' shapes are copied from their published config.json files; `tiny-*` match tests/helpers/tiny_checkpoints.py.
"""
from __future__ import annotations

from typing import Any


def _opt(hidden: int, ffn: int, layers: int, heads: int, **kw: Any) -> dict[str, Any]:
    return dict(
        architectures=["OPTForCausalLM"], vocab_size=50272, hidden_size=hidden, ffn_dim=ffn,
        num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=2048,
        word_embed_proj_dim=hidden, do_layer_norm_before=True, activation_function="relu",
        bos_token_id=2, eos_token_id=2, pad_token_id=1, torch_dtype="float16", **kw,
    )


def _llama(hidden: int, inter: int, layers: int, heads: int, kv: int, **kw: Any) -> dict[str, Any]:
    base = dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu",
        bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False, torch_dtype="bfloat16",
    )
    return {**base, **kw}


def _mixtral(hidden: int, inter: int, layers: int, heads: int, vocab: int, max_pos: int, **kw: Any) -> dict[str, Any]:
    base = _llama(
        hidden, inter, layers, heads, 8, architectures=["MixtralForCausalLM"], vocab_size=vocab,
        max_position_embeddings=max_pos, rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2,
        bos_token_id=1, eos_token_id=2,
    )
    return {**base, **kw}


def _qwen3(hidden: int, inter: int, layers: int, heads: int, kv: int, **kw: Any) -> dict[str, Any]:
    base = _llama(
        hidden, inter, layers, heads, kv, architectures=["Qwen3ForCausalLM"], vocab_size=151936, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, bos_token_id=151643,
        eos_token_id=151645,
    )
    return {**base, **kw}


def _deepseek_v2(**kw: Any) -> dict[str, Any]:
    """DeepSeek-V2-Lite's published config.json (deepseek-ai/DeepSeek-V2-Lite: 15.7B parameters, 2.4B active)."""
    base = dict(
        architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, moe_layer_freq=1,
        n_group=1, topk_group=1, topk_method="greedy", scoring_func="softmax", norm_topk_prob=False,
        routed_scaling_factor=1.0, max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                      "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
        hidden_act="silu", tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001,
        torch_dtype="bfloat16",
    )
    return {**base, **kw}


PRESETS: dict[str, dict[str, Any]] = {
    "opt-125m": _opt(768, 3072, 12, 12),
    "opt-1.3b": _opt(2048, 8192, 24, 32),
    "opt-6.7b": _opt(4096, 16384, 32, 32),
    "opt-30b": _opt(7168, 28672, 48, 56),
    "opt-66b": _opt(9216, 36864, 64, 72),
    "opt-175b": _opt(12288, 49152, 96, 96),
    "llama-3-8b": _llama(4096, 14336, 32, 32, 8),
    "llama-3-70b": _llama(8192, 28672, 80, 64, 8),
    "mixtral-8x7b": _mixtral(4096, 14336, 32, 32, 32000, 32768),
    "mixtral-8x22b": _mixtral(6144, 16384, 56, 48, 32768, 65536),
    "llama-3.1-405b": _llama(
        16384, 53248, 126, 128, 8, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, 8),
    "qwen3-30b-a3b": _qwen3(
        2048, 6144, 48, 32, 4, architectures=["Qwen3MoeForCausalLM"], num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    ),
    "gemma-3-27b": dict(
        architectures=["Gemma3ForCausalLM"], vocab_size=262208, hidden_size=5376, intermediate_size=21504,
        num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
        query_pre_attn_scalar=168, sliding_window=1024, sliding_window_pattern=6, tie_word_embeddings=True,
        final_logit_softcapping=None, attn_logit_softcapping=None, bos_token_id=2, eos_token_id=[1, 106],
        pad_token_id=0, torch_dtype="bfloat16",
    ),
    "deepseek-v2-lite": _deepseek_v2(),
    "tiny-opt": dict(
        _opt(64, 128, 2, 4), vocab_size=320, max_position_embeddings=256, torch_dtype="float32"
    ),
    "tiny-llama": _llama(
        64, 128, 2, 4, 2, vocab_size=320, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
        rms_norm_eps=1e-6, rope_theta=10000.0, torch_dtype="float32",
    ),
    "tiny-mixtral": _mixtral(
        64, 96, 2, 4, 320, 256, num_key_value_heads=2, num_local_experts=4, torch_dtype="float32"
    ),
    "tiny-deepseek-v2": _deepseek_v2(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
        rope_scaling={"type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                      "original_max_position_embeddings": 64},
        bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    ),
}
