"""Tiny random Hugging Face checkpoints built offline from configs (`save_pretrained`), no download.

`TINY_CONFIGS`: the first families (OPT, Llama, Qwen2, Mistral, Mixtral), built plainly; the `tiny-*` presets
in engine/models/presets.py match them. `FAMILIES`: the later HF-folder families, built with their norms and
router biases perturbed and embeddings scaled up (`build_checkpoint_from_spec`) so that (1 + w) norms, q/k norms
and logit caps are exercised.
"""
from __future__ import annotations

from pathlib import Path

import torch

TINY_CONFIGS: dict[str, dict] = {
    "opt": dict(
        cls="OPTConfig", vocab_size=320, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64,
        bos_token_id=2, eos_token_id=2, pad_token_id=1,
    ),
    "llama": dict(
        cls="LlamaConfig", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    ),
    "qwen2": dict(
        cls="Qwen2Config", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    "mistral": dict(
        cls="MistralConfig", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256, sliding_window=None,
        bos_token_id=1, eos_token_id=2,
    ),
    "mixtral": dict(
        cls="MixtralConfig", vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=None, bos_token_id=1, eos_token_id=2,
    ),
}

FAMILY_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                     eos_token_id=2, pad_token_id=0)
_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.1 * i for i in range(8)],
                 long_factor=[2.0 + 0.5 * i for i in range(8)])
FAMILIES: dict[str, dict] = {
    "qwen3": dict(cls="Qwen3Config", head_dim=32, tie_word_embeddings=False),
    "mistral_window": dict(cls="MistralConfig", num_key_value_heads=1, sliding_window=8),
    "qwen2_moe": dict(cls="Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False, num_hidden_layers=3,
                      mlp_only_layers=[1]),
    "qwen3_moe": dict(cls="Qwen3MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, head_dim=32),
    "gemma2": dict(cls="Gemma2Config", head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                   attn_logit_softcapping=0.5, final_logit_softcapping=0.3, num_hidden_layers=3),
    "gemma3": dict(cls="Gemma3TextConfig", head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_hidden_layers=3,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "phi3": dict(cls="Phi3Config", rope_parameters=_LONGROPE, original_max_position_embeddings=64),
}


def build_tiny_checkpoint(kind: str, path: Path, seed: int = 0):
    """Save a tiny random `transformers` model of `kind` (a TINY_CONFIGS key) to `path`; return the HF model."""
    import transformers

    spec = dict(TINY_CONFIGS[kind])
    config = getattr(transformers, spec.pop("cls"))(**spec)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    return model


def build_checkpoint_from_spec(spec: dict, path: Path):
    """Save a tiny random transformers model of config `spec` ({"cls": config class name, **fields}) to `path`
    with its norms and router biases perturbed and embeddings scaled up; return it (eager attention)."""
    import transformers

    spec = dict(spec)
    config = getattr(transformers, spec.pop("cls"))(**spec)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:                                   # norms: not all ones / zeros
                p.add_(torch.randn_like(p) * 0.2)
            elif "embed" in name:
                p.mul_(5.0)                                    # logits large enough for the caps to bite
        for module in model.modules():
            if getattr(module, "e_score_correction_bias", None) is not None:
                module.e_score_correction_bias.normal_(0.0, 0.1)   # a buffer: steers DeepSeek-V3's choice
    model.save_pretrained(path)
    return model


def build_family_checkpoint(kind: str, path: Path):
    """Save a tiny random transformers model of `kind` (a FAMILIES key) to `path`; return it (eager attention)."""
    return build_checkpoint_from_spec({**FAMILY_COMMON, **FAMILIES[kind]}, path)
