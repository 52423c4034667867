"""`load_model`: a model name or path -> config, family, a lazy weight source, tokenizer folder, fingerprint.

Accepted: a local alias (`smollm2-135m-instruct`; a packaged one such as `qwen2.5-0.5b-instruct` is first
assembled into the model cache, engine.models.packaged), a dummy preset (`opt-175b`), a Hugging Face folder
(config.json + safetensors) or a .gguf file. Never a hub download. A GGUF's config and tokenizer are
converted once into the model cache (`engine.models.cache.model_cache_dir()`: one folder per machine, shared by every result
cache and process, never under `$LLMOPS_CACHE_DIR`); its weights are read from the GGUF's own quantized
blocks at load (engine.models.gguf_source), so no dequantized copy is stored.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.models.aliases import ALIASES, alias_available, alias_install, alias_path, resolve_alias
from engine.models.base import ModelFamily
from engine.models.cache import model_cache_dir
from engine.models.config import ModelConfig
from engine.models.dummy_source import DummySource
from engine.models.gguf_convert import convert_gguf, gguf_fingerprint
from engine.models.gguf_source import GGUFSource, read_index
from engine.models.hf_config import config_from_hf
from engine.models.int4_source import Int4SafetensorsSource
from engine.models.presets import PRESETS
from engine.models.registry import build_family, check_architecture
from engine.models.safetensors_source import SafetensorsSource
from engine.models.weights import WeightSource, layer_nbytes
from engine.quant.config import GGUF_WEIGHT_QUANT
from engine.util.file_digest import file_digest

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


@dataclass
class LoadedModel:
    """A model ready for the runtime. `tokenizer_dir` holds tokenizer.json + tokenizer_config.json (with
    chat_template, eos_token, bos_token when known) or is None (dummy presets). `fingerprint` is a stable id
    of the weights' content (a result-cache key): every byte of every weight file is hashed
    (`engine.util.file_digest`, once per file version), so any changed tensor changes it. `dtype` is the
    dtype `weights.get` returns."""

    config: ModelConfig
    family: ModelFamily
    weights: WeightSource
    tokenizer_dir: Path | None
    fingerprint: str
    dtype: torch.dtype


def resolve_dtype(dtype: torch.dtype | str, config: ModelConfig) -> torch.dtype:
    """"auto" -> the checkpoint's dtype (config.torch_dtype); a name or torch.dtype otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = config.torch_dtype if dtype == "auto" else str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use 'auto' or one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _accepted() -> str:
    return (
        f"an alias ({', '.join(sorted(ALIASES))}), a preset ({', '.join(PRESETS)}), "
        "a Hugging Face folder (config.json + *.safetensors) or a .gguf file"
    )


def _read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; load_model accepts {_accepted()}")
    try:
        d = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            extra = json.loads(gen.read_text()).get("eos_token_id")
        except ValueError as e:
            raise ValueError(f"{gen} is not valid JSON: {e}") from None
        d = {**d, "eos_token_id": _union(d.get("eos_token_id"), extra)}
    config = config_from_hf(d)
    check_architecture(config.architecture)
    return config


def _union(a: int | list[int] | None, b: int | list[int] | None) -> list[int]:
    """config.json's eos ids then generation_config.json's extra ones (instruct models add end-of-turn)."""
    out: list[int] = []
    for v in (a, b):
        for t in [v] if isinstance(v, int) else (v or []):
            if t not in out:
                out.append(int(t))
    return out


def _folder_fingerprint(folder: Path, files: list[Path], cache_dir: Path | None) -> str:
    """config.json's bytes and the content digest of every weight file (`engine.util.file_digest`, remembered
    in the model cache `cache_dir`): any changed tensor changes it, an identical copy of the folder keeps it."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in files:
        h.update(f"{f.name}:{file_digest(f, cache_dir)}".encode())
    return h.hexdigest()[:32]


def _load_folder(folder: Path, dtype: torch.dtype | str, fingerprint: str | None = None,
                 cache_dir: Path | None = None) -> LoadedModel:
    config = _read_config(folder)
    family = build_family(config)
    dt = resolve_dtype(dtype, config)
    ignored = family.ignored_prefixes() if hasattr(family, "ignored_prefixes") else ()
    quant = config.quantization_config
    if quant is None:
        source = SafetensorsSource(folder, family.layer_specs(), dt, ignored)
    else:
        source = Int4SafetensorsSource(folder, family.layer_specs(), dt, quant, ignored)
    has_tok = (folder / "tokenizer.json").is_file()
    return LoadedModel(
        config, family, source, folder if has_tok else None,
        fingerprint or _folder_fingerprint(folder, source.files, cache_dir or model_cache_dir()), dt,
    )


def _load_gguf(path: Path, dtype: torch.dtype | str, cache_dir: Path | None) -> LoadedModel:
    models = Path(cache_dir) if cache_dir else model_cache_dir()
    folder = convert_gguf(path, models)
    # compress_weights re-quantizes in groups of 32, the width of llama.cpp's Q4/Q8 blocks (engine.quant.config)
    config = replace(_read_config(folder), weight_group_size=GGUF_WEIGHT_QUANT.group_size)
    family = build_family(config)
    dt = resolve_dtype(dtype, config)
    source = GGUFSource(path, read_index(folder), family.layer_specs(), dt)
    return LoadedModel(config, family, source, folder, gguf_fingerprint(path, models), dt)


def _load_preset(name: str, dtype: torch.dtype | str) -> LoadedModel:
    config = config_from_hf(PRESETS[name])
    dt = resolve_dtype(dtype, config)
    digest = hashlib.sha256(json.dumps(["preset", name, config.to_dict()], sort_keys=True).encode())
    return LoadedModel(config, build_family(config), DummySource(name, dt), None, digest.hexdigest()[:32], dt)


def load_model(
    model: str | Path, *, dtype: torch.dtype | str = "auto", cache_dir: Path | None = None
) -> LoadedModel:
    """Load `model` (alias, preset name, HF folder or .gguf path). Reads headers only: weights stay on disk
    until `weights.get(spec)`. Errors name the file / tensor / architecture at fault. `cache_dir`: where a
    GGUF's conversion and an assembled packaged model live (default `model_cache_dir()`)."""
    if isinstance(model, str) and model in ALIASES:
        return _load_gguf(resolve_alias(model, Path(cache_dir) if cache_dir else None), dtype, cache_dir)
    if isinstance(model, str) and model in PRESETS:
        return _load_preset(model, dtype)
    path = Path(model).expanduser()
    if path.is_dir():
        return _load_folder(path, dtype, cache_dir=cache_dir)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _load_gguf(path, dtype, cache_dir)
    if path.exists():
        raise ValueError(f"cannot load {str(model)!r}: not a folder or .gguf file; load_model accepts {_accepted()}")
    raise FileNotFoundError(f"model {str(model)!r} not found; load_model accepts {_accepted()}")


def list_models() -> list[dict]:
    """Every name `load_model` knows without a path: aliases (with availability) and presets (with sizes:
    `params` and `bytes` count a tied embedding once; `bytes_streamed` is the sum of all layers' weights in
    the preset's dtype, a tied embedding counted in both embed and head)."""
    rows: list[dict] = []
    for name, alias in ALIASES.items():
        path, available = alias_path(alias), alias_available(alias)
        rows.append({
            "name": name, "kind": "alias", "available": available,
            "path": str(path) if path else None, "description": alias.description,
            "install": None if available else alias_install(alias),
        })
    for name, d in PRESETS.items():
        config = config_from_hf(d)
        family = build_family(config)
        dt = resolve_dtype("auto", config)
        specs = family.layer_specs()
        unique = {ws.sources: ws.numel for s in specs for ws in s.weights.values()}  # tied weights once
        rows.append({
            "name": name, "kind": "preset", "available": True, "architecture": config.architecture,
            "params": sum(unique.values()), "bytes": sum(unique.values()) * dt.itemsize,
            "bytes_streamed": sum(layer_nbytes(s, dt) for s in specs),
            "dtype": str(dt).removeprefix("torch."),
            "description": "dummy weights",
        })
    return rows
