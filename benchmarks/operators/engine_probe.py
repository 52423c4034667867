"""Watching the engine while a product path runs it: calls, groups, tokens and plans of `LLM.stream`, the
engine's counters over a path, the model's shape, and the machine's load."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class StreamProbe:
    """Wraps `llm.stream` on the instance: counts calls, groups, rows and generated tokens, notes when the first
    group arrived and which plan each call used. `reset()` per path; `undo()` restores the method."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._orig = llm.stream
        llm.stream = self.stream
        self.reset()

    def reset(self) -> None:
        self.calls = self.groups = self.rows = self.tokens = 0
        self.first: float | None = None
        self.plans: list[dict[str, Any]] = []
        self.threads: set[str] = set()

    def stream(self, prompts: Any, params: Any = None, **kwargs: Any):
        self.calls += 1
        self.threads.add("main" if threading.current_thread() is threading.main_thread() else "worker")
        for group in self._orig(prompts, params, **kwargs):
            if self.first is None:
                self.first = time.perf_counter()
            self.groups += 1
            self.rows += len(group)
            self.tokens += sum(len(c.token_ids) for _, c in group)
            yield group
        self._note_plan()

    def _note_plan(self) -> None:
        plan = getattr(self.llm, "last_plan", None)
        if plan is not None and hasattr(plan, "to_dict"):
            entry = plan.to_dict()
        else:
            policy = getattr(self.llm, "policy", None)
            entry = {"policy": policy.to_dict() if hasattr(policy, "to_dict") else str(policy)}
        key = json.dumps(entry, sort_keys=True, default=str)
        for seen in self.plans:
            if seen["key"] == key:
                seen["calls"] += 1
                return
        self.plans.append({"key": key, "calls": 1, **entry})

    def plans_out(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in p.items() if k != "key"} for p in self.plans]

    def undo(self) -> None:
        self.llm.stream = self._orig


def loadavg() -> float | None:
    """The 1-minute load average (other processes on a small machine move every number)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def stats_snapshot(llm: Any) -> Any:
    """A snapshot of the engine's `EngineStats` (None for an engine without them)."""
    stats = getattr(llm, "stats", None)
    return stats.snapshot() if hasattr(stats, "snapshot") else None


def stats_since(llm: Any, before: Any) -> dict[str, Any] | None:
    """The engine's counters since `before` (`stats_snapshot`): blocks, prefilled_ahead, steps, tokens and
    seconds; None without stats."""
    stats = getattr(llm, "stats", None)
    if before is None or not hasattr(stats, "since"):
        return None
    d = stats.since(before).to_dict()
    keep = ("blocks", "prefilled_ahead", "steps", "generated_tokens", "plan_s", "place_s", "prefill_s", "decode_s",
            "grammar_mask_s", "grammar_advance_s", "callback_s")
    return {k: (round(d[k], 3) if isinstance(d[k], float) else d[k]) for k in keep if k in d}


def plans_ahead(plans: list[dict[str, Any]]) -> bool | list[bool] | None:
    """Whether the path's plan(s) had `Policy.prefill_ahead`: one flag, or one per plan when they differ."""
    flags = [bool((p.get("policy") or {}).get("prefill_ahead")) for p in plans if isinstance(p.get("policy"), dict)]
    if not flags:
        return None
    return flags[0] if len(set(flags)) == 1 else flags


def model_info(llm: Any, model: str) -> dict[str, Any]:
    """The engine's model as a record names it: name, path, shape fields, dtype, fingerprint, parameters, and
    for a random-weight benchmark model (`models/build_bench_model.py`) its shape and seed."""
    c = llm.config
    info: dict[str, Any] = {"name": Path(model).name if os.path.sep in model else model, "path": model,
                            "architecture": c.architecture, "hidden_size": c.hidden_size,
                            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
                            "num_key_value_heads": c.num_key_value_heads, "intermediate_size": c.intermediate_size,
                            "vocab_size": c.vocab_size, "tie_word_embeddings": c.tie_word_embeddings,
                            "dtype": str(llm.dtype).removeprefix("torch."), "fingerprint": getattr(llm, "fingerprint", None),
                            "num_local_experts": getattr(c, "num_local_experts", None),
                            "int4": c.quantization_config.tag if getattr(c, "quantization_config", None) else None}
    try:
        specs = llm.loaded.family.layer_specs()
        info["params"] = sum({ws.sources: ws.numel for s in specs for ws in s.weights.values()}.values())
    except Exception:  # noqa: BLE001 (informative only)
        info["params"] = None
    bench = Path(model) / "bench_model.json"
    if bench.is_file():
        meta = json.loads(bench.read_text())
        info.update(shape=meta.get("shape"), random_weights=True, seed=meta.get("seed"))
    else:
        info["random_weights"] = False
    return info


def prompt_token_counts(llm: Any, prompts: list[Any], params: Any) -> list[int] | None:
    """Prompt lengths as the engine encodes them (chat template applied); None when that API is not there."""
    try:
        from engine.decoding.prompts import encode_prompts

        enc = encode_prompts(prompts, params, llm.tokenizer, llm.config.vocab_size, llm.max_context)
        return [len(e.ids) for e in enc]
    except Exception:  # noqa: BLE001
        return None

