"""Model families (one file each, built from `layers` and `attention`), the architecture registry and weight loading.

Families: opt, llama (Llama/Mistral/Qwen2), mixtral, qwen3, qwen2_moe, qwen3_moe, gemma2, gemma3, phi3,
deepseek_v2, deepseek_v3; the registry (engine.models.registry) maps each HF `architectures` string to one of
them. Weight sources: safetensors folders (float, or AWQ / GPTQ int4: int4_source), GGUF files, dummy presets.

Public entry points: `load_model`, `LoadedModel`, `list_models` (engine.models.loader) and the
`ModelFamily` / `LayerSpec` / `WeightSpec` contract (engine.models.base). Pure maths and weight sources:
nothing here imports `engine.storage` or `engine.runtime` (placement is theirs).
"""
from engine.models.base import LayerSpec, ModelFamily, WeightSpec
from engine.models.config import ModelConfig
from engine.models.loader import LoadedModel, list_models, load_model

__all__ = ["LayerSpec", "LoadedModel", "ModelConfig", "ModelFamily", "WeightSpec", "list_models", "load_model"]
