"""`Plan`: the policy a job runs with, how it was chosen, and its explanation for people and as JSON."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.calibrate.planning.workload import covers, workload_from_list, workload_list
from engine.policy.cost_model import Workload
from engine.policy.estimate import PolicyEstimate, workload_dict
from engine.policy.partition import explain_split
from engine.policy.policy import Policy

SOURCES = {"fixed": "given by the caller (a fixed policy)", "search": "planned now",
           "trials": "planned now", "memory": "reused from an earlier plan in this process",
           "disk": "from the plan cache"}
CHOSEN_BY = {"given": "the caller", "cost model": "the cost model (deterministic for the model, budgets, workload "
             "bucket and hardware profile)", "trials": "trials: the cost model's best candidates measured on "
             "truncated copies of the model"}
_ESTIMATE_KEYS = ("policy", "predicted_tokens_per_s", "prefill_s", "decode_s", "peak_memory_bytes", "peak_memory_gib",
                  "bottlenecks")


@dataclass(frozen=True)
class Plan:
    """The policy a job runs with.

    `workload`: the bucket it was planned for (None for a fixed policy, which covers everything).
    `source`: where this plan object came from: "fixed", "search" or "trials" (planned now), "memory"
    (reused in this process) or "disk" (the plan cache). `chosen_by`: what picked the policy: "given",
    "cost model" or "trials" (kept through the cache). `estimate`: the cost model's (or the trials')
    prediction, None for a fixed policy. `pending_trials`: in a preview, how many candidates the job's run
    will measure to refine this plan (0: the run uses this plan as it is). `devices`: the split over several
    devices (`engine.policy.partition.device_split`), None on one. `cache_file`: where the plan cache holds it."""

    policy: Policy
    workload: Workload | None = None
    source: str = "fixed"
    chosen_by: str = "given"
    estimate: PolicyEstimate | None = field(default=None, compare=False)
    planning_s: float = 0.0
    pending_trials: int = 0
    devices: dict[str, Any] | None = field(default=None, compare=False)
    cache_file: str | None = field(default=None, compare=False)

    @property
    def predicted_tokens_per_s(self) -> float | None:
        """The prediction for one device (None for a fixed policy)."""
        return None if self.estimate is None else self.estimate.predicted_tokens_per_s

    def covers(self, workload: Workload) -> bool:
        """Whether this plan's memory bounds `workload` (`planning.workload.covers`)."""
        return covers(self.workload, workload)

    def explain(self) -> str:
        """Where the plan comes from and what chose it, the bucket, then the estimate: batch shape, placement
        per tier, flags, predicted tokens/s, bottlenecks and peak memory per tier (and the device split)."""
        took = f" in {self.planning_s:.1f} s" if self.planning_s >= 0.05 else ""
        lines = [f"Plan: {SOURCES.get(self.source, self.source)}{took}; chosen by "
                 f"{CHOSEN_BY.get(self.chosen_by, self.chosen_by)}"]
        if self.cache_file:
            lines.append(f"  cached in  {self.cache_file}")
        if self.pending_trials:
            lines.append(f"  trials     a run first measures the best {self.pending_trials} candidates and may pick "
                         "another policy (cached: a later preview shows it)")
        if self.workload is not None:
            w = self.workload
            lines.append(f"  bucket     prompts up to {w.memory_prompt_len} tokens (mean {w.prompt_len}"
                         + (f", {w.shared_prefix_len} shared" if w.shared_prefix_len else "")
                         + f"), {w.gen_len} new tokens, "
                         + (f"{w.num_prompts} prompts" if w.num_prompts else "any number of prompts"))
        lines.append(self.estimate.explain() if self.estimate is not None else f"  policy     {self.policy.to_dict()}")
        if self.devices is not None:
            lines.append(explain_split(self.devices))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the policy, the bucket (a dict), where it came from and what chose it, the prediction
        (`predicted_tokens_per_s`, `predicted_prefill_s` / `predicted_decode_s` per block,
        `predicted_peak_bytes` per tier), the estimate's context (budgets, profile, trials), the split and
        the plan cache's file."""
        out: dict[str, Any] = {"policy": self.policy.to_dict(), "source": self.source, "chosen_by": self.chosen_by,
                               "planning_s": self.planning_s, "pending_trials": self.pending_trials,
                               "workload": None if self.workload is None else workload_dict(self.workload),
                               "predicted_tokens_per_s": self.predicted_tokens_per_s, "devices": self.devices,
                               "cache_file": self.cache_file}
        est = self.estimate
        if est is not None:
            data = est.to_dict()
            out.update({k: v for k, v in data.items() if k not in _ESTIMATE_KEYS and k != "workload"})
            out.update(predicted_prefill_s=est.prefill_s, predicted_decode_s=est.decode_s,
                       predicted_peak_bytes={t: int(n) for t, n in est.peak_memory_bytes.items()},
                       bottlenecks=dict(est.bottlenecks))
        return out


def plan_record(plan: Plan) -> dict[str, Any]:
    """What the plan cache stores of `plan` (`plan_from_record` reads it back)."""
    w = plan.workload
    return {"policy": plan.policy.to_dict(), "workload": None if w is None else workload_list(w),
            "chosen_by": plan.chosen_by, "devices": plan.devices,
            "estimate": None if plan.estimate is None else plan.estimate.to_dict()}


def plan_from_record(data: dict[str, Any], cache_file: str) -> Plan:
    """A cached plan (source "disk"); KeyError, TypeError or ValueError when `data` is not a plan record."""
    est = data["estimate"]
    estimate = None if est is None else PolicyEstimate(
        Policy.from_dict(est["policy"]), float(est["predicted_tokens_per_s"]), float(est["prefill_s"]),
        float(est["decode_s"]), {t: int(n) for t, n in est["peak_memory_bytes"].items()}, dict(est["bottlenecks"]),
        {k: v for k, v in est.items() if k not in _ESTIMATE_KEYS})
    workload = None if data["workload"] is None else workload_from_list(data["workload"])
    return Plan(Policy.from_dict(data["policy"]), workload, "disk", str(data["chosen_by"]), estimate,
                devices=data["devices"], cache_file=cache_file)
