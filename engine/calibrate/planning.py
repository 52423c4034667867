"""A job's plan: the policy one run over a table uses for all of its engine calls, and the plan cache.

Planning (`policy="auto"`: the cost model's search, then on a GPU trials of the best candidates on truncated
copies of the model) costs seconds to minutes, so it happens once per job, not once per call:
- a workload is planned in buckets (`bucketed`): prompt lengths and new tokens rounded up to 4 steps per
  octave, the prompt count up to a power of two, the shared prefix down to a multiple of `PREFIX_STEP`
  tokens (then the mean prompt is the prefix plus the mean of the rows' own tokens rounded up). Every call
  whose workload falls in an already planned bucket reuses that plan; rounding the lengths up and the prefix
  down keeps the plan's memory a bound for every workload inside it (a longer prefix computes less);
- a `Plan` given back to `LLM.stream(..., plan=...)` is reused for every call it `covers` (the operator
  layer keeps one per job: DuckDB vectors, Polars groups and morsels);
- plans chosen by trials are stored on disk (`PlanCache`, beside the hardware profile, keyed by the model's
  shape, dtype, machine, budgets, compression and the bucket), so a rerun on the machine measures nothing.
A cached file is written to a temporary name and renamed; one that does not parse or whose key differs is
ignored and replaced.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from engine.policy.cost_model import Workload
from engine.policy.policy import Policy
from engine.storage.atomic import write_json_atomic

PLAN_VERSION = 2   # bump when what a cached plan means changes (cost model, trials, policy fields)
PREFIX_STEP = 16   # a bucket's shared prefix: the workload's rounded down to a multiple of this


def bucket(n: int) -> int:
    """`n` rounded up to 4 steps per octave: 1..8 as is, then 10, 12, 14, 16, 20, 24, 28, 32, 40, ..."""
    n = max(1, int(n))
    if n <= 8:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def bucketed(prompt_lens: Sequence[int], max_new_tokens: int, shared_prefix_len: int = 0) -> Workload:
    """The planning bucket of a workload: the longest prompt and new tokens rounded up (`bucket`), the prompt
    count up to a power of two, the leading tokens every prompt shares down to a multiple of `PREFIX_STEP`,
    and the mean prompt that prefix plus the mean of the rows' own tokens rounded up (without a prefix: the
    mean prompt rounded up). The own tokens are what the prefill pays per row, so they are rounded, not the
    whole prompt: 150 shared + 50 own is planned as 144 + 56, not as 224 tokens with 144 of them shared."""
    lens = [max(1, int(n)) for n in prompt_lens] or [1]
    count = 1 << max(0, math.ceil(math.log2(len(lens))))
    longest = bucket(max(lens))
    prefix = shared_prefix_len // PREFIX_STEP * PREFIX_STEP
    mean = prefix + bucket(math.ceil(sum(lens) / len(lens)) - prefix)
    return Workload(prompt_len=min(longest, mean), gen_len=bucket(max_new_tokens), num_prompts=count,
                    max_prompt_len=longest, shared_prefix_len=prefix)


def merged(a: Workload, b: Workload) -> Workload:
    """A bucket holding both workloads (the larger of each figure, the smaller of the shared prefixes)."""
    return Workload(prompt_len=max(a.prompt_len, b.prompt_len), gen_len=max(a.gen_len, b.gen_len),
                    num_prompts=max(a.num_prompts or 1, b.num_prompts or 1),
                    max_prompt_len=max(a.memory_prompt_len, b.memory_prompt_len),
                    shared_prefix_len=min(a.shared_prefix_len, b.shared_prefix_len))


@dataclass(frozen=True)
class Plan:
    """The policy a job runs with. `workload` is the bucket it was planned for (None for a fixed policy,
    which covers everything); `source` says where it came from: "fixed" (given by the caller), "search"
    (the cost model), "trials" (measured candidates), "memory" (reused in this process) or "disk" (the plan
    cache); `explanation` is the estimate's readable text (empty for a fixed policy). `detail` holds the
    cost model's prediction for a planned policy (`predicted_detail`: peak bytes per tier, prefill and
    decode seconds per block) and, from the plan cache, `planned_s`."""

    policy: Policy
    workload: Workload | None = None
    source: str = "fixed"
    explanation: str = ""
    predicted_tokens_per_s: float | None = None
    planning_s: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict, compare=False)

    def covers(self, workload: Workload) -> bool:
        """Whether this plan's memory bounds `workload`: its longest prompt and new tokens fit the bucket, and
        its prompts share at least the bucket's prefix."""
        w = self.workload
        return w is None or (workload.memory_prompt_len <= w.memory_prompt_len and workload.gen_len <= w.gen_len
                             and workload.shared_prefix_len >= w.shared_prefix_len)

    def explain(self) -> str:
        """Which policy will run and where it came from, then the estimate's lines."""
        head = {"fixed": "fixed policy (given)", "search": "planned now by the cost model",
                "trials": "planned now by trials of the cost model's best candidates",
                "memory": "reused from an earlier plan in this process",
                "disk": "from the plan cache (planned earlier on this machine)"}.get(self.source, self.source)
        lines = [f"Plan: {head}" + (f" in {self.planning_s:.1f} s" if self.planning_s >= 0.05 else "")]
        if self.workload is not None:
            w = self.workload
            lines.append(f"  bucket     prompts up to {w.memory_prompt_len} tokens (mean {w.prompt_len}"
                         + (f", {w.shared_prefix_len} shared" if w.shared_prefix_len else "")
                         + f"), {w.gen_len} new tokens, {w.num_prompts} prompts")
        lines.append(self.explanation or f"  policy     {self.policy.to_dict()}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the policy, the bucket, source, prediction and planning seconds."""
        w = self.workload
        return {"policy": self.policy.to_dict(), "source": self.source, "planning_s": self.planning_s,
                "predicted_tokens_per_s": self.predicted_tokens_per_s,
                "workload": None if w is None else workload_list(w), **self.detail}


PREDICTED = ("predicted_peak_bytes", "predicted_prefill_s", "predicted_decode_s")


def predicted_detail(peak_bytes: dict[str, int], prefill_s: float, decode_s: float) -> dict[str, Any]:
    """A plan's `detail` entries for the cost model's prediction: peak bytes per tier, seconds per block."""
    return {"predicted_peak_bytes": {t: int(n) for t, n in peak_bytes.items()},
            "predicted_prefill_s": float(prefill_s), "predicted_decode_s": float(decode_s)}


def workload_list(w: Workload) -> list[int]:
    """A workload as the plan cache keys and stores it: prompt, new tokens, prompts, longest, shared prefix."""
    return [w.prompt_len, w.gen_len, int(w.num_prompts or 0), w.memory_prompt_len, w.shared_prefix_len]


class PlanCache:
    """Plans on disk, one JSON file per key under `directory` (see module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def path(self, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
        return self.directory / f"plan-{digest}.json"

    def get(self, key: dict[str, Any]) -> Plan | None:
        """The stored plan for `key` (source "disk"), or None when absent, unreadable or for another key."""
        try:
            data = json.loads(self.path(key).read_text())
            if data.get("version") != PLAN_VERSION or data.get("key") != json.loads(json.dumps(key, default=str)):
                return None
            w = data["workload"]
            workload = Workload(prompt_len=w[0], gen_len=w[1], num_prompts=w[2] or None, max_prompt_len=w[3],
                                shared_prefix_len=w[4])
            detail = {"planned_s": data.get("planning_s"), **{k: data[k] for k in PREDICTED if k in data}}
            return Plan(Policy.from_dict(data["policy"]), workload, "disk", str(data.get("explanation", "")),
                        data.get("predicted_tokens_per_s"), 0.0, detail)
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return None

    def put(self, key: dict[str, Any], plan: Plan) -> None:
        """Store `plan` under `key` atomically (a temporary file renamed into place)."""
        write_json_atomic(self.path(key), {"version": PLAN_VERSION, "key": key, **plan.to_dict(),
                                           "explanation": plan.explanation})
