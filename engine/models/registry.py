"""Architecture registry: the Hugging Face `architectures` string -> the family class, imported lazily.

Data, not code: adding an architecture is one line here plus a parity test in tests/engine/test_models_parity.py
(the first families) or tests/engine/test_families_parity.py (Qwen3, Qwen-MoE, Gemma2/3, Phi3, Mistral's window),
tests/engine/test_deepseek_parity.py (DeepSeek-V2/V3).
"""
from __future__ import annotations

import importlib

from engine.models.base import ModelFamily
from engine.models.config import ModelConfig

# architecture -> (module under engine.models, class name)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "OPTForCausalLM": ("opt", "OPTFamily"),
    "LlamaForCausalLM": ("llama", "LlamaFamily"),
    "MistralForCausalLM": ("llama", "LlamaFamily"),
    "Qwen2ForCausalLM": ("llama", "LlamaFamily"),
    "MixtralForCausalLM": ("mixtral", "MixtralFamily"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3Family"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeFamily"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeFamily"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2Family"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3Family"),
    "Phi3ForCausalLM": ("phi3", "Phi3Family"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2Family"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3Family"),
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def check_architecture(architecture: str) -> None:
    """Raise ValueError naming `architecture` and listing the supported ones when it is unknown."""
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )


def family_class(architecture: str) -> type:
    """The family class for `architecture` (its module is imported on first use)."""
    check_architecture(architecture)
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"engine.models.{module}"), name)


def build_family(config: ModelConfig) -> ModelFamily:
    """The family object computing `config`'s layers."""
    return family_class(config.architecture)(config)
