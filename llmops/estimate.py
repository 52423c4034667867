"""What a job would cost, before it runs (`llmops run --dry-run`): rows, the rows the result cache and
deduplication already serve, prompt and generated tokens, the plan's predicted speed, and the time that
gives. Nothing is generated and no trial runs; the plan is the engine's preview of the plan the run uses
(`llmops.core.plan_job(..., measure=False)`: the run's rule, over the same rows: a plan this process or the
plan cache holds, else the cost model's choice, saying whether the run's trials will refine it), and its
explanation carries the peak memory per tier.

Figures: `rows` the table's rows; `null_rows` rows that do not run (a null or empty placeholder, a render
failure); `cached_rows` rows whose result the cache holds; `deduped_rows` rows served by another row's
identical prompt; `rows_to_generate` distinct prompts left; `prompt_tokens` their prompt tokens (counted on
a sample of at most `SAMPLE` prompts, scaled); `max_generated_tokens` the bound `rows_to_generate x
max_new_tokens` (rows stop earlier at EOS, a stop string or a closed schema); `predicted_tokens_per_s`
and `seconds_at_most` = max_generated_tokens / predicted_tokens_per_s (prefill included in the prediction);
`plan` the plan's explanation, `plan_detail` the plan as JSON (`Plan.to_dict()`; None without a plan).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa

from llmops.core import CacheDir, MapSpec, engine_lock, get_engine, plan_job, rows_by_result_key, sampling_params
from llmops.result_cache import open_cache
from llmops.templates import check_columns, render_rows

SAMPLE = 512


@dataclass
class JobEstimate:
    """The figures of one job before it runs (see module docstring)."""

    rows: int
    null_rows: int
    cached_rows: int
    deduped_rows: int
    rows_to_generate: int
    prompt_tokens: int
    max_generated_tokens: int
    predicted_tokens_per_s: float | None
    seconds_at_most: float | None
    plan: str = ""
    plan_detail: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def duration(seconds: float | None) -> str:
    """A duration for people: 42 s, 17 min, 3.5 h (? when unknown)."""
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def estimate_job(table: pa.Table, spec: MapSpec, *, cache_dir: CacheDir = None, engine: Any = None) -> JobEstimate:
    """The estimate of running `spec` over `table` (TemplateError for a template naming a missing column)."""
    names = check_columns(spec.template, table.column_names)
    outcomes = render_rows(spec.template, {f: table.column(f).to_pylist() for f in names}, table.num_rows,
                           system=spec.system, examples=spec.examples, on_empty=spec.on_empty)
    null_rows = sum(1 for o in outcomes if o.prompt is None)
    eng = engine if engine is not None else (get_engine(spec) if null_rows < len(outcomes) else None)
    by_key = rows_by_result_key(outcomes, spec, eng) if eng is not None else {}
    cache = open_cache(cache_dir) if cache_dir is not False and by_key else None
    hits = cache.get_many(list(by_key)) if cache is not None else {}
    cached_rows = sum(len(by_key[k]) for k in hits)
    pending = [k for k in by_key if k not in hits]
    deduped = sum(len(by_key[k]) - 1 for k in pending)
    params = sampling_params(spec)
    step = max(1, len(pending) // SAMPLE)
    sample = [outcomes[by_key[k][0]].prompt for k in pending[::step][:SAMPLE]]
    prompt_tokens, speed, plan_text = 0, None, ""
    if sample and hasattr(eng, "prompt_tokens"):
        counted = eng.prompt_tokens(sample, params)
        prompt_tokens = round(sum(counted) * len(pending) / len(sample))
    plan = None
    if pending and eng is not None:
        with engine_lock(eng):
            plan = plan_job(eng, [outcomes[by_key[k][0]].prompt for k in pending], params, measure=False)
    if plan is not None:
        speed, plan_text = plan.predicted_tokens_per_s, plan.explain()
    bound = len(pending) * spec.max_new_tokens
    return JobEstimate(rows=table.num_rows, null_rows=null_rows, cached_rows=cached_rows, deduped_rows=deduped,
                       rows_to_generate=len(pending), prompt_tokens=prompt_tokens, max_generated_tokens=bound,
                       predicted_tokens_per_s=speed, seconds_at_most=bound / speed if speed else None,
                       plan=plan_text, plan_detail=None if plan is None else plan.to_dict())
