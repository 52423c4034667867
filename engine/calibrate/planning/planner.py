"""`Planner`: the plans of one model under one set of settings, chosen once per workload bucket.

A bucket's plan is, in this order: one this process already made, one the plan cache holds, else the cost
model's choice, stored in the cache (on a CUDA profile, where the search takes seconds). A bucket whose
prompt count is a power of two (`workload.count_bucket`: where `workload.exact_count` is false)
is also served by a plan for up to 2^11 times as many prompts whose block fits it. A count in between is
planned as it is: it decides how many blocks the job runs and how full the last is, so it gets its own plan.
With `trials` > 0, a run (`measure=True`) on a local GPU then refines a plan the cost model chose by trials of
its best candidates and stores the refined plan under the same key; a preview (`measure=False`) never runs
trials and says that the run will (`Plan.pending_trials`). So a preview and a run plan alike, and a preview
after a run shows the plan the run used.

A job's later calls go through `plan_for`, which keeps the job's plan while it covers them.
"""
from __future__ import annotations

import functools
import time
from dataclasses import replace
from typing import Callable

import torch

from engine.calibrate.planning import choose
from engine.calibrate.planning.cache import PlanCache, plan_key
from engine.calibrate.planning.plan import Plan
from engine.calibrate.planning.settings import PlanSettings, resolve_budgets
from engine.calibrate.planning.workload import exact_count, merged, workload_list
from engine.models.config import ModelConfig
from engine.policy.cost_model import Workload
from engine.policy.estimate import Budgets, PolicyEstimate
from engine.policy.hardware import HardwareProfile
from engine.policy.layout import ModelLayout
from engine.policy.memory import peak_memory
from engine.policy.model_stats import dtype_bytes
from engine.policy.partition import device_split
from engine.policy.policy import Policy
from engine.runtime.layout import model_layout

MAX_PLAN_SHIFT = 12     # a power-of-two count is served by plans for up to 2^11 times as many prompts


class Planner:
    """Plans for `config` under `settings` on the machine `profile` describes (a profile, or a function
    returning it, called at the first plan: measuring a GPU takes a minute once). `fixed`: the caller's
    policy (every plan is it), else None ("auto"). `device`: the local device trials run on (None: a
    preview elsewhere, which never measures); `before_trials` is called before trials run (the facade
    closes its executor, so trials have the whole device budget). Not thread-safe (the facade is not)."""

    def __init__(self, config: ModelConfig, settings: PlanSettings, *, dtype: torch.dtype,
                 profile: HardwareProfile | Callable[[], HardwareProfile], model_name: str,
                 fixed: Policy | None = None, device: torch.device | None = None,
                 before_trials: Callable[[], None] | None = None, cache: PlanCache | None = None) -> None:
        self.config, self.settings, self.dtype, self.model_name = config, settings, dtype, model_name
        self.fixed, self.device, self._before_trials = fixed, device, before_trials
        self._profile = profile
        self._cache = cache
        self._plans: dict[tuple[int, ...], Plan] = {}

    @functools.cached_property
    def profile(self) -> HardwareProfile:
        return self._profile if isinstance(self._profile, HardwareProfile) else self._profile()

    @functools.cached_property
    def layout(self) -> ModelLayout:
        """The model's weight layout the cost model plans from (`engine.runtime.layout.model_layout`)."""
        return model_layout(self.config, self.dtype)

    @functools.cached_property
    def budgets(self) -> Budgets:
        """Each device's budgets (`settings.resolve_budgets`)."""
        return resolve_budgets(self.profile, self.settings)

    @property
    def cache(self) -> PlanCache | None:
        """The plan cache, on a CUDA profile (a CPU plan is a closed form: nothing to keep)."""
        if self.profile.device_type != "cuda":
            return None
        if self._cache is None:
            self._cache = PlanCache()
        return self._cache

    def plan_for(self, workload: Workload, given: Plan | None) -> Plan:
        """The plan of a job's call over the bucket `workload`: `given` (the job's plan) when it covers the
        workload, or when its policy also fits the larger bucket holding both (the job goes on with it,
        nothing re-planned); else the plan of that larger bucket. A call with more prompts than `given` was
        planned for re-plans when `given`'s block was bounded by its prompt count (a job whose first call
        was small: a larger block may pay). A preview's plan whose trials are pending is refined first."""
        if self.fixed is not None:
            return given if given is not None and given.policy == self.fixed else Plan(self.fixed)
        if given is not None and given.pending_trials and given.workload is not None:
            given = self.plan(given.workload)
        if given is None or given.workload is None:
            return given if given is not None else self.plan(workload)
        w = given.workload
        count, planned = workload.num_prompts or 1, w.num_prompts or 1
        outgrown = count > planned and 2 * given.policy.block_size > planned
        both = merged(workload, w)
        if given.covers(workload) and not outgrown:
            return given
        if not outgrown and self._fits(given.policy, both):
            return self._remember(both, replace(given, workload=both))
        return self.plan(both)

    def plan(self, workload: Workload, *, measure: bool = True) -> Plan:
        """The plan of the bucket `workload` (see module docstring); `measure=False`: a preview."""
        if self.fixed is not None:
            return Plan(self.fixed)
        plan = self._known(workload) or self._store(workload, self._choose(workload))
        if plan.chosen_by == "cost model" and self.settings.trials > 0 and self.profile.device_type == "cuda":
            if measure and self.device is not None and self.device.type == "cuda":
                plan = self._store(workload, self._choose(workload, trials=self.settings.trials))
            else:
                plan = replace(plan, pending_trials=self.settings.trials)
        return plan

    def key(self, workload: Workload) -> dict:
        """The plan cache's key for `workload`'s plan (`cache.plan_key`)."""
        return plan_key(self.config, self.dtype, self.profile, self.budgets, self.settings, workload)

    def _known(self, workload: Workload) -> Plan | None:
        """A plan this process or the plan cache holds for the bucket (or, for a count bucketed to a power of
        two, for a bucket of more prompts whose block fits this one's), as this bucket's plan."""
        exact = self._plans.get(tuple(workload_list(workload)))
        if exact is not None:
            return replace(exact, source="memory")
        count, cache = workload.num_prompts, self.cache
        shifts = 1 if count and exact_count(count) else MAX_PLAN_SHIFT
        for more in [count << shift for shift in range(shifts)] if count else [None]:
            sibling = replace(workload, num_prompts=more)
            plan = self._plans.get(tuple(workload_list(sibling)))
            source = "memory"
            if plan is None and cache is not None:
                plan, source = cache.get(self.key(sibling)), "disk"
            if plan is not None and (count is None or plan.policy.block_size <= count):
                return self._remember(workload, replace(plan, workload=workload, source=source))
        return None

    def _store(self, workload: Workload, plan: Plan) -> Plan:
        cache = self.cache
        if cache is not None:
            plan = cache.put(self.key(workload), plan)
        return self._remember(workload, plan)

    def _remember(self, workload: Workload, plan: Plan) -> Plan:
        self._plans[tuple(workload_list(workload))] = plan
        return plan

    def _fits(self, policy: Policy, workload: Workload) -> bool:
        """Whether `policy`'s modelled peak memory for `workload` stays inside the budgets (on a CPU device
        the executor's own budget check decides)."""
        if self.profile.device_type != "cuda":
            return True
        B, config = dtype_bytes(self.dtype), self.config
        peak = peak_memory(config, self.layout.view(B, policy.compress_weights), policy,
                           workload.memory_prompt_len, workload.gen_len, B, "cuda",
                           shared_prefix_len=workload.shared_prefix_len)
        return peak["gpu"] <= self.budgets.gpu_bytes and peak["cpu"] <= self.budgets.cpu_bytes

    def _choose(self, workload: Workload, trials: int = 0) -> Plan:
        """The cost model's plan for `workload`, or with `trials` its refinement measured on the device."""
        s = self.settings
        kwargs = dict(dtype=self.dtype, compress_weights=s.compress_weights, compress_cache=s.compress_cache,
                      model_name=self.model_name, layout=self.layout)
        start = time.perf_counter()
        if trials:
            if self._before_trials is not None:
                self._before_trials()
            est: PolicyEstimate = choose.refine(self.config, workload, self.budgets, self.profile, device=self.device,
                                                trials=trials, trial_time_s=s.trial_time_s, disk_dir=s.disk_dir,
                                                **kwargs)
        else:      # looked up at call time: tests count the choices
            est = choose.cost_model_choice(self.config, workload, self.budgets, self.profile, **kwargs)
        devices = None if s.num_devices == 1 else device_split(
            self.config, est.policy, s.num_devices, dtype_bytes(self.dtype), est.predicted_tokens_per_s, s.parallel)
        return Plan(est.policy, workload, "trials" if trials else "search", "trials" if trials else "cost model",
                    est, time.perf_counter() - start, devices=devices)
