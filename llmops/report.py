"""The run report of a pipeline: a JSON file beside the sink, written at the end of every `llmops run`.

`<sink>.report.json` (for a DuckDB sink `<database>.<table>.report.json`) holds: `run` (the summary:
rows read and written, tokens, tokens/s, cache hits, failed rows, seconds), `time` (where the wall time
went: `source`, each `llm_map` step, `sink` (writing and publishing), `other`; on the Ray runner, whose
steps overlap in one streaming dataset, `setup` and `ray_dataset_and_sink`), and per llm_map step:
its figures (`llmops.summary.RunSummary`), `failures` (rows by reason: `cut by max_new_tokens`,
`prompt too long`, `empty input`, `unparsable output`, `not one of the choices`, `engine error`),
`timeline` ([seconds since the step began, rows done, generated tokens] per emitted batch: throughput over
time) and `plan` (the engine's plan: policy, source, `predicted_tokens_per_s`) beside the measured
`tokens_per_s`. The runner writes it atomically (`llmops.core.write_json_atomic`). Pure Python: no engine,
no core (core imports `failure_kind` from here).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

REPORT_VERSION = 1


def failure_kind(finish_reason: str | None, error: str | None) -> str | None:
    """The reason a row's output is null, as one of a few kinds (None for a good or a plain null row)."""
    if error is None and finish_reason != "error":
        return None
    text = error or ""
    if finish_reason == "length" or "max_new_tokens" in text:
        return "cut by max_new_tokens"
    if "exceeds the context" in text or "too long" in text:
        return "prompt too long"
    if "is empty" in text or "are empty" in text:
        return "empty input"
    if "unparsable" in text:
        return "unparsable output"
    if "not one of the choices" in text:
        return "not one of the choices"
    return "engine error"


def report_path(sink_kind: str, target: str, table: str | None = None) -> Path:
    """Where the report of a run writing to this sink goes (beside it)."""
    base = Path(target.split(":", 1)[0] if sink_kind == "database" else target)
    name = f"{base.name}.{table}" if sink_kind == "database" and table else base.name
    return base.with_name(f"{name}.report.json")


def build_report(run: dict[str, Any], times: dict[str, float], steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's JSON object from the run summary (`RunResult.to_dict()`), the time split and the
    llm_map steps (each with figures, failures, timeline and plan)."""
    total = float(run.get("seconds") or 0.0)
    accounted = sum(times.values())
    out_steps = []
    for s in steps:
        plan = s.get("plan") or {}
        predicted = plan.get("predicted_tokens_per_s")
        measured = s.get("tokens_per_s")
        out_steps.append({**s, "predicted_tokens_per_s": predicted, "measured_tokens_per_s": measured,
                          "measured_over_predicted": (measured / predicted) if predicted and measured else None})
    return {"version": REPORT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "run": run, "time": {**times, "other": max(0.0, total - accounted)}, "llm_steps": out_steps}
