"""`PolicyEstimate`: a chosen policy with the cost model's prediction, explained for people and as JSON."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.policy.cost_model import TIERS, Workload
from engine.policy.policy import Policy
from engine.util.sizes import format_size


class NoFeasiblePolicy(ValueError):
    """No batch shape and placement fits the memory budgets; the message says what does not fit."""


@dataclass(frozen=True)
class Budgets:
    """Memory each tier may hold, in bytes (hard limits; `search` relaxes them by its factors)."""

    gpu_bytes: int
    cpu_bytes: int
    disk_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("gpu_bytes", "cpu_bytes", "disk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"Budgets.{name} must be >= 0, got {getattr(self, name)}")

    def of(self, tier: str) -> int:
        return int(getattr(self, f"{tier}_bytes"))


@dataclass(frozen=True)
class PolicyEstimate:
    """The chosen `policy` and its prediction: generated tokens/s, seconds per block for the prefill and
    the decode, and peak bytes per tier {gpu, cpu, disk}. `bottlenecks` names the channel bounding a
    prefill layer and a decode layer; `context` holds what the estimate was made for (model, profile,
    workload, budgets) for `explain()`."""

    policy: Policy
    predicted_tokens_per_s: float
    prefill_s: float
    decode_s: float
    peak_memory_bytes: dict[str, int]
    bottlenecks: dict[str, str] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: policy fields, prediction, peak memory in bytes and GiB, bottlenecks, context."""
        return {
            "policy": self.policy.to_dict(),
            "predicted_tokens_per_s": self.predicted_tokens_per_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "peak_memory_bytes": dict(self.peak_memory_bytes),
            "peak_memory_gib": {t: self.peak_memory_bytes[t] / 1024**3 for t in TIERS},
            "bottlenecks": dict(self.bottlenecks),
            **self.context,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def explain(self) -> str:
        """A few lines a person can read: placement, flags, prediction, the bottleneck, memory use. On a CPU
        (`context["device_type"]`) the compute tier is called "device" and a block's batches just batches."""
        p, ctx = self.policy, self.context
        cpu = ctx.get("device_type") == "cpu"
        gpu, batches = ("device", "batch(es)") if cpu else ("gpu", "GPU batch(es)")
        lines = []
        model = ctx.get("model", "model")
        lines.append(f"Policy for {model} on {ctx.get('device_name', '?')} (profile: {ctx.get('profile_source', '?')})")
        workload = ctx.get("workload")
        if workload:
            lines.append(
                f"  workload   prompt {workload['prompt_len']} tokens"
                + (f" ({workload['shared_prefix_len']} shared)" if workload.get("shared_prefix_len") else "")
                + f", generate {workload['gen_len']}"
                + (f", {workload['num_prompts']} prompts" if workload.get("num_prompts") else "")
            )
        lines.append(
            f"  block      {p.block_size} sequences = {p.num_gpu_batches} {batches} x {p.gpu_batch_size}"
        )
        for label, name, compressed in (("weights", "w", p.compress_weights), ("kv cache", "cache", p.compress_cache),
                                         ("hidden", "act", False)):
            shares = [getattr(p, f"{name}_{tier}") for tier in TIERS]
            text = "  ".join(f"{gpu if tier == 'gpu' else tier} {100 * v:5.1f}%" for tier, v in zip(TIERS, shares))
            lines.append(f"  {label:<10} {text}" + ("  (4-bit)" if compressed else ""))
            if name == "w" and p.w_gpu_extra:
                share = ctx.get("extra_weights_share")
                lines.append(f"  {'':<10} + {p.w_gpu_extra} whole tensors on the {gpu}: the first streamed tensor of "
                             f"each of the first {p.w_gpu_extra} layers that stream one"
                             + (f" ({100 * share:.1f}% of the weight bytes)" if share is not None else ""))
            held = ctx.get("held_weights") if name == "w" else None
            if held:
                lines.append(f"  {'':<10} {', '.join(held['kinds'])} held on the {gpu} whatever the share says "
                             f"({100 * held['share']:.1f}% of the weight bytes: their streamed copy would need "
                             f"a buffer as large)")
        flags = [f for f in ("overlap", "cpu_attention", "compress_weights", "compress_cache", "cpu_dense_copy",
                             "prefill_ahead") if getattr(p, f)]
        if p.weight_pages:                                   # set by the search for MoE models only
            flags.append(f"pipeline, {p.weight_pages} weight pages" if p.pipeline else "pipeline off")
        lines.append(f"  flags      {', '.join(flags) or 'none'}")
        lines.append(
            f"Predicted  {self.predicted_tokens_per_s:.2f} generated tokens/s; per block prefill "
            f"{self.prefill_s:.2f} s{' in series (the rest ahead, inside the decode)' if p.prefill_ahead else ''}, "
            f"decode {self.decode_s:.2f} s"
        )
        predicted, trials = ctx.get("predicted"), ctx.get("trials")
        if trials:
            whose = ("the cost model's (the trial read faster than this bound)"
                     if ctx.get("trial", {}).get("bounded_by_model")
                     else "the trial's, extrapolated from runs of truncated copies")
            lines.append(f"Selected by {ctx.get('selected_by', 'trial')} among {len(trials)} candidate(s) by measured "
                         f"throughput bounded by the prediction; the numbers above are {whose}"
                         + (f" (cost model: {predicted['tokens_per_s']:.2f} tokens/s)" if predicted else ""))
            for t in trials:
                p_ = t["policy"]
                shape = (f"{p_['num_gpu_batches']}x{p_['gpu_batch_size']}"
                         + (" cpu-attention" if p_["cpu_attention"] else ""))
                got = (f"trial {t['trial_tokens_per_s']:.2f}" if "trial_tokens_per_s" in t
                       else t.get("error") or t.get("skipped") or "not run")
                lines.append(f"  candidate {shape:<22} predicted {t['predicted_tokens_per_s']:.2f}, {got}")
        if self.bottlenecks:
            prefill, decode = (str(self.bottlenecks.get(k)).replace("gpu", gpu) for k in ("prefill", "decode"))
            lines.append(f"Bottleneck prefill: {prefill}; decode: {decode}")
        budgets = ctx.get("budgets_bytes", {})
        mem = []
        for tier in TIERS:
            used = format_size(self.peak_memory_bytes[tier])
            cap = budgets.get(tier)
            label = gpu if tier == "gpu" else tier
            mem.append(f"{label} {used}" + (f" of {format_size(cap)}" if cap is not None else ""))
        lines.append("Peak memory " + ", ".join(mem))
        return "\n".join(lines)


def workload_dict(workload: Workload) -> dict[str, Any]:
    return {"prompt_len": workload.prompt_len, "gen_len": workload.gen_len,
            "num_prompts": workload.num_prompts, "max_prompt_len": workload.memory_prompt_len,
            "shared_prefix_len": workload.shared_prefix_len}
