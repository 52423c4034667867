"""The second bridge to `engine`, declared as such: the engine's planning tools for the CLI.

`llmops.core` is the bridge for running a model over rows; this module is the bridge for the commands that
only plan or inspect (`llmops policy`, `llmops profile`, `llmops models`): model configs, hardware profiles,
the policy search and its split over several GPUs, byte sizes, the model list and atomic JSON and text
files (run reports). `llmops.core` re-exports everything here, and the CLI imports it from there
(`from llmops import core`), so `core` stays the one module other llmops modules use to reach the engine;
only these two modules import `engine` (checked by tests/test_import_contracts.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engine.calibrate.machine import PINNED_SHARE, default_cpu_budget
from engine.calibrate.profile_cache import load_or_measure, load_profile, profile_cache_path
from engine.models.config import ModelConfig
from engine.models.hf_config import config_from_hf
from engine.models.loader import list_models, load_model, resolve_dtype
from engine.models.presets import PRESETS
from engine.policy.cost_model import Workload
from engine.policy.estimate import Budgets, NoFeasiblePolicy, PolicyEstimate
from engine.policy.hardware import HardwareProfile, reference_profile
from engine.policy.model_stats import dtype_bytes
from engine.policy.partition import device_split, explain_split
from engine.policy.search import search
from engine.storage.atomic import write_json_atomic, write_text_atomic
from engine.util.sizes import format_size, parse_size

__all__ = [
    "PINNED_SHARE", "Budgets", "HardwareProfile", "NoFeasiblePolicy", "PolicyEstimate", "Workload",
    "cuda_available", "default_cpu_budget", "device_profile_path", "device_split", "dtype_bytes", "engine_models",
    "explain_split", "format_size",
    "list_models", "load_or_measure", "load_profile", "model_config", "parse_size", "profile_cache_path",
    "reference_profile", "resolve_dtype", "search", "write_json_atomic", "write_text_atomic",
]


def cuda_available() -> bool:
    """Whether this machine has a CUDA GPU torch can use (the CLI's default device and hardware)."""
    return torch.cuda.is_available()


def model_config(model: str) -> ModelConfig:
    """A ModelConfig for a preset name, a Hugging Face folder / config.json, or anything `load_model` takes."""
    if model in PRESETS:
        return config_from_hf(PRESETS[model])
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file() and path.suffix == ".json":
        return config_from_hf(json.loads(path.read_text()))
    return load_model(model).config


def device_profile_path(device: str) -> Path:
    """Where `load_or_measure(device)` caches this machine's profile for `device` ("cuda" or "cpu")."""
    return profile_cache_path(torch.device(device))


def engine_models() -> list[dict[str, Any]]:
    """The engine's aliases and presets (`engine.models.loader.list_models`)."""
    return list(list_models())
