"""llmops' offloading inference engine. Imports no operator-layer library (Polars, DuckDB, Ray, click).

Layers, arrows down (checked by tests/test_import_contracts.py, contracts in pyproject.toml):
`llm` (the facade) -> `calibrate` (machine, measurement, trials, planning) -> `runtime` (schedule,
executor) -> `policy` (pure decision) -> `storage` -> `models` / `quant` (pure maths); `decoding` (params,
sampling, constraints, prompts, tokenizer, chat) and `util` are leaves used from above.

The names below are the facade: what a caller outside the engine (`llmops.core`) uses. Generating: `LLM`,
`SamplingParams` (`check_choices`), `Completion`. Planning (one path, `engine.calibrate.planning`):
`LLM.plan` and `plan_model` (a model not loaded, another machine's profile) return a `Plan` for a
`Workload`, within budgets from one rule (`resolve_budgets`, `PlanSettings`, `Budgets`; `PINNED_SHARE`);
`Policy` / `as_policy` for a fixed plan; `NoFeasiblePolicy` when nothing fits. Machines: this machine's
`HardwareProfile` measured once and cached (`load_or_measure`, `profile_cache_path`), the one plans for a
device use (`planning_profile`), one read from a file (`load_profile`), a built-in one
(`reference_profile`), `default_device`. Models: `list_models`. Sizes: `parse_size`, `format_size`. Files written whole or not
at all: `write_text_atomic`, `write_json_atomic`.
"""
from engine.calibrate.machine import PINNED_SHARE
from engine.calibrate.planning import Plan, PlanSettings, plan_model, planning_profile, resolve_budgets
from engine.calibrate.profile_cache import load_or_measure, load_profile, profile_cache_path
from engine.decoding.params import Completion, SamplingParams, check_choices
from engine.llm import LLM, resolve_device
from engine.models.loader import list_models
from engine.policy.cost_model import Workload
from engine.policy.estimate import Budgets, NoFeasiblePolicy
from engine.policy.hardware import HardwareProfile, reference_profile
from engine.policy.policy import Policy, as_policy
from engine.storage.atomic import write_json_atomic, write_text_atomic
from engine.util.sizes import format_size, parse_size


def default_device() -> str:
    """The compute device `LLM(device="auto")` uses here: "cuda" when a GPU is visible, else "cpu"."""
    return resolve_device("auto").type


__all__ = ["LLM", "PINNED_SHARE", "Budgets", "Completion", "HardwareProfile", "NoFeasiblePolicy", "Plan",
           "PlanSettings", "Policy", "SamplingParams", "Workload", "as_policy", "check_choices", "default_device",
           "format_size", "list_models", "load_or_measure", "load_profile", "parse_size", "plan_model",
           "planning_profile", "profile_cache_path", "reference_profile", "resolve_budgets", "write_json_atomic",
           "write_text_atomic"]
