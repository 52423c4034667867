"""The plan cache: plans on disk beside the hardware profile, so a rerun on the machine plans nothing.

One JSON file per key under `plan_dir()` (`$LLMOPS_CACHE_DIR/plans` or `~/.cache/llmops/plans`), named by
the key's digest. The key (`plan_key`) is everything a plan depends on: the model's shape (its config, not
its weights), the dtype, the hardware profile's numbers, each device's budgets, the number of devices and
how they are used, the compression settings, the workload bucket, and the planning code itself
(`code_digest`: the cost model, the search and the trials, so an edit to them invalidates what they
planned). A file is written to a temporary name and renamed into place; on read it is verified (format
version, the whole key, a digest of its content) and one that fails is ignored, then replaced when the
plan is made again.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from engine.calibrate.planning.plan import Plan, plan_from_record, plan_record
from engine.calibrate.planning.settings import PlanSettings
from engine.calibrate.planning.workload import workload_list
from engine.models.config import ModelConfig
from engine.policy.cost_model import Workload
from engine.policy.estimate import Budgets
from engine.policy.hardware import HardwareProfile
from engine.storage.atomic import write_json_atomic
from engine.util.paths import cache_dir

PLAN_VERSION = 3   # bump when the file's format changes (the planning code's own changes are in the key)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


@functools.cache
def code_digest() -> str:
    """A digest of the sources that decide a plan: `engine.policy` (cost and memory model, search), the
    trials and this package."""
    root = Path(__file__).resolve().parents[2]
    files = sorted([*(root / "policy").glob("*.py"), root / "calibrate" / "trial.py",
                    *Path(__file__).parent.glob("*.py")])
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def profile_digest(profile: HardwareProfile) -> str:
    """The profile's numbers and identity (not where it was read from)."""
    return _digest({k: v for k, v in profile.to_dict().items() if k != "source"})[:16]


def plan_key(config: ModelConfig, dtype: torch.dtype, profile: HardwareProfile, budgets: Budgets,
             settings: PlanSettings, workload: Workload) -> dict[str, Any]:
    """What a cached plan depends on (see module docstring). The number of trials is not in it: trials
    refine the cost model's plan of the same key in place."""
    return {"config": config.to_dict(), "dtype": str(dtype).removeprefix("torch."),
            "profile": profile_digest(profile),
            "budgets": [budgets.gpu_bytes, budgets.cpu_bytes, budgets.disk_bytes],
            "devices": [settings.num_devices, settings.parallel],
            "compress": [settings.compress_weights, settings.compress_cache],
            "workload": workload_list(workload), "code": code_digest()}


def plan_dir() -> Path:
    """The plan cache's folder, beside the hardware profile."""
    return cache_dir() / "plans"


class PlanCache:
    """Plans on disk under `directory`, one verified JSON file per key (see module docstring)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else plan_dir()

    def path(self, key: dict[str, Any]) -> Path:
        return self.directory / f"plan-{_digest(key)[:24]}.json"

    def get(self, key: dict[str, Any]) -> Plan | None:
        """The stored plan for `key` (source "disk"), or None when absent, unreadable, altered or another key's."""
        path = self.path(key)
        try:
            data = json.loads(path.read_text())
            if (data.get("version") != PLAN_VERSION or data.get("key") != json.loads(json.dumps(key, default=str))
                    or data.get("digest") != _digest(data["plan"])):
                return None
            return plan_from_record(data["plan"], str(path))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
            return None

    def put(self, key: dict[str, Any], plan: Plan) -> Plan:
        """Store `plan` under `key` atomically; returns it with `cache_file` set."""
        path = self.path(key)
        record = json.loads(json.dumps(plan_record(plan), default=str))
        write_json_atomic(path, {"version": PLAN_VERSION, "key": key, "plan": record, "digest": _digest(record)})
        return replace(plan, cache_file=str(path))
