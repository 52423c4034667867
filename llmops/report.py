"""The run report of a pipeline: a JSON file beside the sink, written at the end of every `llmops run`.

`<sink>.report.json` (for a DuckDB sink `<database>.<table>.report.json`), version 2, holds:
- `run`: the summary (rows read and written, tokens, tokens/s, cache hits, failed rows, seconds);
- `time`: where the run's wall time went, seconds that sum to `run.seconds`: `source`, then the llm_map
  steps' parts summed (`load` the engine, `place_weights` on the tiers, `plan`, `prefill`, `decode`,
  `grammar_mask`, `cache` the result cache), `sink` (writing and publishing) and `other` (the rest:
  rendering, parsing, table steps). On the Ray runner, whose steps overlap in one streaming dataset:
  `setup`, `ray_dataset_and_sink`, `other`;
- `llm_steps`, per llm_map step: its figures (`llmops.summary.RunSummary`, with the rows and seconds of each
  model, the rows a cascade escalated and the histogram of the answers' confidence), `failures` (rows by reason:
  `cut by max_new_tokens`, `prompt too long`, `empty input`, `unparsable output`, `not one of the
  choices`, `engine error`), `timeline` ([seconds since the step began, rows done, generated tokens] per
  emitted batch), `throughput` (rows finished per time bucket: `{"bucket_s", "rows"}`,
  `llmops.row_clock`), `time` (the step's own split, as above, `other` its rest), `engine` (the engine's
  counters over the step, `engine.runtime.run_stats`; null for an engine without them), `plan` (policy,
  source, the cost model's prediction) and `comparison`: predicted vs measured generated tokens/s
  (measured over the engine's prefill + decode + grammar time, which is what the cost model predicts, and
  over the step's wall time) and peak bytes per tier (predicted by the cost model; measured as the
  executor's budget counts them). Predictions are null for a fixed policy or an engine without plans.
The runner writes it atomically (`llmops.core.write_json_atomic`); `llmops run --report FILE.html` renders
it (`llmops.report_html`). Pure Python: no engine, no core (core imports `failure_kind` from here).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

REPORT_VERSION = 2
STEP_PARTS = ("load", "place_weights", "plan", "prefill", "decode", "grammar_mask", "cache")
TIERS = ("gpu", "cpu", "disk")


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


def comparison(step: dict[str, Any]) -> dict[str, Any]:
    """Predicted vs measured speed and peak memory per tier of one llm_map step (see module docstring)."""
    plan, eng = step.get("plan") or {}, step.get("engine") or {}
    tokens = eng.get("generated_tokens") or step.get("generated_tokens") or 0
    engine_s = sum(float(eng.get(k) or 0.0) for k in ("prefill_s", "decode_s", "grammar_mask_s"))
    predicted = plan.get("predicted_tokens_per_s")
    measured = tokens / engine_s if engine_s > 0 and tokens else None
    peaks_p, peaks_m = plan.get("predicted_peak_bytes") or {}, eng.get("peak_bytes") or {}
    return {
        "predicted_tokens_per_s": predicted,
        "engine_tokens_per_s": measured,
        "wall_tokens_per_s": step.get("tokens_per_s"),
        "measured_over_predicted": measured / predicted if predicted and measured else None,
        "predicted_block_s": {"prefill": plan.get("predicted_prefill_s"), "decode": plan.get("predicted_decode_s")},
        "peak_bytes": {t: {"predicted": peaks_p.get(t), "measured": peaks_m.get(t)} for t in TIERS},
        "device_peak_bytes": eng.get("device_peak_bytes"),
    }


def build_report(run: dict[str, Any], times: dict[str, float], steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's JSON object from the run summary (`RunResult.to_dict()`), the run's own times (`source`,
    `sink`, or the Ray runner's parts) and the llm_map steps (each with figures, failures, timeline,
    throughput, its `time` split, engine counters and plan). `time` gets the steps' parts summed and
    `other`, the rest of `run.seconds`."""
    total = float(run.get("seconds") or 0.0)
    split = dict(times)
    for part in STEP_PARTS if steps else ():
        split[part] = sum(float((s.get("time") or {}).get(part, 0.0)) for s in steps)
    split["other"] = max(0.0, total - sum(split.values()))
    return {"version": REPORT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "run": run, "time": split, "llm_steps": [{**s, "comparison": comparison(s)} for s in steps]}
