"""The one model cache folder: GGUF conversions (engine.models.gguf_convert) and assembled packaged models
(engine.models.packaged) live here, one folder per machine shared by every result cache and process."""
from __future__ import annotations

import os
from pathlib import Path


def model_cache_dir() -> Path:
    """The one model cache (GGUF conversions, assembled packaged models): `$LLMOPS_MODEL_CACHE`, else
    `~/.cache/llmops/models`. It does not follow `$LLMOPS_CACHE_DIR` (result caches and hardware profiles), so
    pointing runs at separate result caches never converts or assembles a model again."""
    env = os.environ.get("LLMOPS_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llmops" / "models"
