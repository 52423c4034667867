"""`Planner`: the plans of one engine (one model, device, dtype and budgets), chosen once per job.

The facade (`engine.llm.LLM`) asks it for the plan of each call; it keeps the plans of this process by
workload bucket, reads and writes the disk plan cache on CUDA, and runs the policy search (with trials on
a GPU) only for a bucket nothing known serves. See `engine.calibrate.planning` for buckets, `Plan` and the cache.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from engine.calibrate import auto, machine
from engine.calibrate.machine import profile_key
from engine.calibrate.planning import Plan, PlanCache, bucketed, merged, predicted_detail, workload_list
from engine.models.loader import LoadedModel
from engine.policy.cost_model import Workload
from engine.policy.memory import model_layout, peak_memory
from engine.policy.model_stats import dtype_bytes
from engine.policy.policy import Policy

MAX_PLAN_SHIFT = 12     # plans for up to 2^11 times a bucket's prompt count are looked up as its plan
AUTO_TRIALS = 4         # on a GPU, policy="auto" measures the cost model's best 4 candidates on truncated copies


class Planner:
    """Plans for one engine. `fixed`: the caller's policy (every plan is it), else None ("auto").
    `before_trials` is called before trials run (the facade closes its executor, so trials have the whole
    device budget). Not thread-safe (the facade is not)."""

    def __init__(self, loaded: LoadedModel, *, device: torch.device, dtype: torch.dtype, fixed: Policy | None,
                 gpu_memory: int | None, cpu_memory: int | None, disk_dir: Path | None, compress_weights: bool,
                 compress_cache: bool, model_name: str, before_trials: Callable[[], None]) -> None:
        self.loaded, self.device, self.dtype, self.fixed = loaded, device, dtype, fixed
        self.gpu_memory, self.cpu_memory, self.disk_dir = gpu_memory, cpu_memory, disk_dir
        self.compress_weights, self.compress_cache = compress_weights, compress_cache
        self.model_name, self._before_trials = model_name, before_trials
        self._plans: dict[tuple[int, ...], Plan] = {}

    def plan_for(self, prompt_lens: list[int], max_new_tokens: int, given: Plan | None,
                 shared_prefix_len: int = 0) -> Plan:
        """`given` when it covers the workload, or when its policy also fits the larger bucket holding both
        (the job goes on with it, nothing re-planned); else the plan of the workload's bucket (merged with
        `given`'s). A call with more prompts than `given` was planned for re-plans when `given`'s block was
        bounded by its prompt count (a job whose first call was small: a larger block may pay).
        `shared_prefix_len`: the leading tokens all the call's prompts share (`auto.prompts_prefix_len`)."""
        if self.fixed is not None:
            return given if given is not None and given.policy == self.fixed else Plan(self.fixed)
        workload = bucketed(prompt_lens, max_new_tokens, shared_prefix_len)
        if given is None or given.workload is None:
            return given if given is not None else self._bucket_plan(workload)
        w = given.workload
        outgrown = (workload.num_prompts or 1) > (w.num_prompts or 1) and 2 * given.policy.block_size > (w.num_prompts or 1)
        both = merged(workload, w)
        if given.covers(workload) and not outgrown:
            return given
        if not outgrown and self._fits(given.policy, both):
            return self._remember(tuple(workload_list(both)), replace(given, workload=both))
        return self._bucket_plan(both)

    def preview(self, prompt_lens: list[int], max_new_tokens: int, shared_prefix_len: int = 0) -> Plan:
        """The plan a job would run with, without trials: a known plan (this process, the plan cache), else
        the cost model's pick (source "search", not kept: trials may still change it)."""
        if self.fixed is not None:
            return Plan(self.fixed)
        workload = bucketed(prompt_lens, max_new_tokens, shared_prefix_len)
        known = self._plans.get(tuple(workload_list(workload)))
        if known is None and self.device.type == "cuda":
            known = PlanCache(self.cache_dir()).get(self.disk_key(workload))
        return known if known is not None else self._choose(workload, trials=0)

    def _fits(self, policy: Policy, workload: Workload) -> bool:
        """Whether `policy`'s modelled peak memory for `workload` stays inside the budgets (on a CPU device
        the executor's own budget check decides)."""
        if self.device.type != "cuda":
            return True
        B, config = dtype_bytes(self.dtype), self.loaded.config
        peak = peak_memory(config, model_layout(config, B, policy.compress_weights), policy,
                           workload.memory_prompt_len, workload.gen_len, B, "cuda",
                           shared_prefix_len=workload.shared_prefix_len)
        return ((self.gpu_memory is None or peak["gpu"] <= self.gpu_memory)
                and (self.cpu_memory is None or peak["cpu"] <= self.cpu_memory))

    def _bucket_plan(self, workload: Workload) -> Plan:
        """The plan of `workload`'s bucket: from this process, else the plan cache, else planned now. A plan
        made for more prompts whose block holds at most this bucket's prompts is this bucket's plan too (the
        search's only use of the prompt count is that bound), so a job of 2,048-row calls reuses the plan of
        a 10,000-row job on the same prompts."""
        key = tuple(workload_list(workload))
        if key in self._plans:
            plan = self._plans[key]
            return plan if plan.source == "memory" else self._remember(key, replace(plan, source="memory"))
        cuda = self.device.type == "cuda"
        cache = PlanCache(self.cache_dir()) if cuda else None
        count = workload.num_prompts or 1
        for more in (count << shift for shift in range(0, MAX_PLAN_SHIFT)):
            sibling = replace(workload, num_prompts=more)
            skey = tuple(workload_list(sibling))
            plan = self._plans.get(skey) or (cache.get(self.disk_key(sibling)) if cache is not None else None)
            if plan is not None and plan.policy.block_size <= count:
                found = replace(plan, workload=workload, source="memory" if skey in self._plans else "disk")
                return self._remember(key, found)
        plan = self._choose(workload, trials=AUTO_TRIALS if cuda else 0)
        if cache is not None and plan.source == "trials":
            cache.put(self.disk_key(workload), plan)
        return self._remember(key, plan)

    def _remember(self, key: tuple[int, ...], plan: Plan) -> Plan:
        self._plans[key] = plan
        return plan

    def _choose(self, workload: Workload, trials: int) -> Plan:
        """Run the policy search (and trials) for `workload`."""
        if trials > 0:
            self._before_trials()
        start = time.perf_counter()
        disk = shutil.disk_usage(self.disk_dir).free if self.disk_dir is not None else 0
        est = auto.choose_policy_estimate(      # looked up at call time: tests count the searches
            self.loaded.config, workload=workload, device=self.device, dtype=self.dtype,
            gpu_memory=self.gpu_memory, cpu_memory=self.cpu_memory, disk_memory=disk,
            compress_weights=self.compress_weights, compress_cache=self.compress_cache, trials=trials,
            disk_dir=self.disk_dir, model_name=self.model_name)
        source = "trials" if est.context.get("trials") else "search"
        return Plan(est.policy, workload, source, est.explain(), est.predicted_tokens_per_s,
                    time.perf_counter() - start, predicted_detail(est.peak_memory_bytes, est.prefill_s, est.decode_s))

    def disk_key(self, workload: Workload) -> dict[str, Any]:
        """What a cached plan depends on: the model's shape (not its weights), dtype, machine and device,
        budgets, compression, the workload bucket and how many candidates were trialled."""
        return {"config": self.loaded.config.to_dict(), "dtype": str(self.dtype), "device": profile_key(self.device),
                "budgets": [self.gpu_memory, self.cpu_memory, str(self.disk_dir) if self.disk_dir else None],
                "compress": [self.compress_weights, self.compress_cache], "workload": workload_list(workload),
                "trials": AUTO_TRIALS}

    @staticmethod
    def cache_dir() -> Path:
        return machine.cache_dir() / "plans"
