"""Planning: the one path from (model, workload, settings, machine) to the `Plan` a job runs with.

`Planner` is the entry point: `engine.LLM` holds one per engine, and `plan_model` makes one for a model
that is not loaded (`llmops policy`, or planning for another machine's profile). Both resolve budgets by
one rule (`settings.resolve_budgets`), choose by the cost model (`choose`), deterministically for a given
model, budgets, workload bucket (`workload`) and hardware profile, keep what they chose in the plan cache
(`cache`), and let trials only refine a cached plan, in a run, never in a preview (`planner`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.calibrate.planning.cache import PlanCache, plan_dir
from engine.calibrate.planning.plan import Plan
from engine.calibrate.planning.planner import Planner
from engine.calibrate.planning.settings import (
    PlanSettings, compute_dtype, planning_profile, resolve_budgets, size_setting,
)
from engine.calibrate.planning.workload import bucketed, bucketed_workload, prompts_prefix_len
from engine.models.config import ModelConfig
from engine.models.hf_config import config_from_hf
from engine.models.loader import load_model
from engine.policy.cost_model import Workload
from engine.policy.hardware import HardwareProfile
from engine.policy.policy import Policy, as_policy

__all__ = ["Plan", "PlanCache", "PlanSettings", "Planner", "bucketed", "bucketed_workload", "compute_dtype",
           "model_config", "plan_dir", "plan_model", "planning_profile", "prompts_prefix_len", "resolve_budgets",
           "size_setting"]


def model_config(model: str | Path) -> ModelConfig:
    """The config of anything `load_model` takes (headers only, no weights), or of a config.json file."""
    path = Path(str(model)).expanduser()
    if path.suffix == ".json" and path.is_file():
        return config_from_hf(json.loads(path.read_text()))
    return load_model(model).config


def plan_model(model: str | Path, workload: Workload, *, profile: HardwareProfile | None = None,
               policy: str | Policy | dict = "auto", gpu_memory: int | str | None = None,
               cpu_memory: int | str | None = None, disk_memory: int | str | None = None,
               disk_dir: str | Path | None = None, dtype: str | torch.dtype = "auto", devices: int = 1,
               parallel: str = "auto", compress_weights: bool | None = False, compress_cache: bool | None = False,
               trials: int = 0) -> Plan:
    """The plan `LLM(model, ...)` with these settings would run a job of `workload` with on the machine
    `profile` describes (default: this machine's, `planning_profile`), without loading the weights: a
    plan this process or the plan cache holds, else the cost model's choice (cached on a CUDA profile);
    no trial runs (`Plan.pending_trials` says when a run would refine it). `workload` is planned in its
    bucket, as the engine plans a job's prompts. `devices`: GPUs of one host (`gpu_memory` on each, the
    host's budgets shared). `compress_*` None lets the search decide. Raises NoFeasiblePolicy (a
    ValueError) naming what does not fit, ValueError for a bad setting, FileNotFoundError for an unknown
    model."""
    settings = PlanSettings(gpu_memory=size_setting("gpu_memory", gpu_memory),
                            cpu_memory=size_setting("cpu_memory", cpu_memory),
                            disk_memory=size_setting("disk_memory", disk_memory),
                            disk_dir=None if disk_dir is None else Path(disk_dir), num_devices=devices,
                            parallel=parallel, compress_weights=compress_weights, compress_cache=compress_cache,
                            trials=trials)
    fixed = as_policy(policy)
    config = model_config(model)
    profile = profile or planning_profile("cuda" if torch.cuda.is_available() else "cpu")
    planner = Planner(config, settings, dtype=compute_dtype(dtype, profile.device_type), profile=profile,
                      model_name=Path(str(model)).name, fixed=fixed if isinstance(fixed, Policy) else None)
    return planner.plan(bucketed_workload(workload), measure=False)
