"""Model families (one file each, built from `layers`), the architecture registry and weight loading.

Families: opt, llama (Llama/Mistral/Qwen2), mixtral, qwen3, qwen2_moe, qwen3_moe, gemma2, gemma3, phi3; the
registry (engine.models.registry) maps each HF `architectures` string to one of them.

Public entry points: `load_model`, `LoadedModel`, `list_models` (engine.models.loader) and the
`ModelFamily` / `LayerSpec` / `WeightSpec` contract (engine.models.base).
"""
from engine.models.base import LayerSpec, ModelFamily, WeightSpec
from engine.models.config import ModelConfig

__all__ = ["LayerSpec", "LoadedModel", "ModelConfig", "ModelFamily", "WeightSpec", "list_models", "load_model"]


def __getattr__(name: str):
    if name in ("LoadedModel", "list_models", "load_model"):
        from engine.models import loader

        return getattr(loader, name)
    raise AttributeError(name)
