"""`llmops run --dry-run`: validate a pipeline against a sample of its data and describe what would run.

Nothing is generated: the source is read with a small limit, table steps run on that sample, and each
llm_map is checked (template columns, examples) and stands in null output columns of its declared type so
later steps and templates can be checked too. Each llm_map gets its job's cost estimate (`llmops.estimate`:
rows, cached rows, tokens, predicted speed and time) over the rows reaching it, with the plan the run will use
(the model is loaded, no executor built, no trial run: `llmops.core.plan_job`'s preview, the run's rule over
the same rows): the last llm_map's is `policy_note` (its explanation: policy, placement, prediction, peak
memory per tier, where it comes from and whether the run's trials will refine it) and `job_plan` (as JSON).
The plan is a dict (JSON-ready); `format_plan` renders it for people.
"""
from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from llmops import core
from llmops.cascade import as_cascade
from llmops.core import output_schema, output_type
from llmops.estimate import duration, estimate_job
from llmops.pipeline.runner import cache_setting
from llmops.pipeline.sinks import SinkWriter
from llmops.pipeline.sources import count_source_rows, read_source
from llmops.pipeline.spec import ROW_WISE, LlmMapStep, Pipeline, step_kind
from llmops.pipeline.semantic_steps import dry_run_semantic, is_semantic
from llmops.pipeline.steps import ROW_COLUMN, apply_step, attach_output, map_spec, step_label
from llmops.result_cache import default_cache_dir
from llmops.templates import RowRenderError, TemplateError, build_prompt, check_columns

ESTIMATE_ROWS = 200_000   # source rows the estimate reads (counts are scaled from them beyond)
POLICY_NOTE = ("chosen when the model loads, from this run's prompt lengths, max_new_tokens and the memory "
               "budgets (see `llmops policy --model ...` to preview one)")


def _null_outputs(table: pa.Table, step: LlmMapStep, pipeline: Pipeline) -> pa.Table:
    spec = map_spec(step.llm_map, pipeline)
    n = table.num_rows
    cols = {f.name: pa.nulls(n, f.type) for f in output_schema(spec)}
    cols["row"] = pa.array(range(n), pa.int64())
    fake = pa.table(cols, schema=output_schema(spec))
    return attach_output(table, fake, step.llm_map).drop_columns([ROW_COLUMN])


def _example_prompt(table: pa.Table, step: LlmMapStep, label: str) -> Any:
    cfg = step.llm_map
    try:
        check_columns(cfg.template, table.column_names)
    except TemplateError as exc:
        raise TemplateError(f"{label}: {exc}") from None
    if table.num_rows == 0:
        return "(no sample row reaches this step)"
    row = table.slice(0, 1).to_pylist()[0]
    try:
        return build_prompt(cfg.template, row, system=cfg.system,
                            examples=[{"input": e.input, "output": e.output} for e in cfg.examples])
    except (TemplateError, RowRenderError) as exc:
        return f"(the first sample row cannot be rendered: {exc})"


def _sample_prompts(table: pa.Table, step: LlmMapStep) -> list[Any]:
    """The prompts of the sample rows that render (the others are left out of the preview)."""
    cfg, prompts = step.llm_map, []
    examples = [{"input": e.input, "output": e.output} for e in cfg.examples]
    for row in table.to_pylist():
        try:
            prompts.append(build_prompt(cfg.template, row, system=cfg.system, examples=examples))
        except (TemplateError, RowRenderError):
            continue
    return prompts


def _policy_preview(pipeline: Pipeline, step: LlmMapStep | None, prompts: list[Any], rows: int) -> str:
    """The plan the engine would run the last llm_map with (`llmops.core.explain_policy`: the model is
    loaded, nothing generated, no trial run), for `rows` rows like the sample's `prompts`; POLICY_NOTE when
    there is no llm_map or no sample prompt."""
    if step is None or not prompts:
        return POLICY_NOTE
    try:
        return core.explain_policy(map_spec(step.llm_map, pipeline), prompts, rows=rows) or POLICY_NOTE
    except Exception as exc:  # noqa: BLE001 (a preview only: the run decides for real)
        return f"{POLICY_NOTE}; preview failed: {type(exc).__name__}: {exc}"


def _estimate(full: pa.Table, step: LlmMapStep, pipeline: Pipeline, cache: Any, scale: float,
              label: str) -> dict[str, Any]:
    """`llmops.estimate.estimate_job` of one llm_map over the rows reaching it (scaled by `scale` when the
    source has more rows than were read); a failure is reported in the dict, never raised."""
    try:
        est = estimate_job(full, map_spec(step.llm_map, pipeline), cache_dir=cache).to_dict()
    except TemplateError as exc:
        raise TemplateError(f"{label}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 (an estimate only: the run decides for real)
        return {"error": f"{type(exc).__name__}: {exc}"}
    if scale > 1:
        for key in ("rows", "null_rows", "cached_rows", "deduped_rows", "rows_to_generate", "prompt_tokens",
                    "max_generated_tokens"):
            est[key] = round(est[key] * scale)
        if est["seconds_at_most"] is not None:
            est["seconds_at_most"] *= scale
        est["scaled_from_rows"] = full.num_rows
    return est


def step_cascade(cfg: Any) -> str:
    """An llm_map step's cascade as text: `a -> b (min_confidence 0.9)` (validated with the step)."""
    chain = as_cascade(cfg.cascade, cfg.min_confidence, constrained=True)
    rule = f"min_confidence {chain.min_confidence}" if chain.min_confidence is not None else "invalid rows only"
    return f"{' -> '.join(chain.models)} ({rule})"


def _describe(step: Any) -> str:
    kind = step_kind(step)
    if isinstance(step, LlmMapStep):
        c = step.llm_map
        constraint = ("schema " + ", ".join(c.schema_.get("properties", {})) if c.schema_ is not None else
                      f"choices {c.choices}" if c.choices is not None else
                      f"regex {c.regex!r}" if c.regex is not None else "free text")
        target = "columns from the schema" if c.unnest else f"column {c.output!r}"
        return (f"llm_map -> {target}: {constraint}; max_new_tokens={c.max_new_tokens}, "
                f"{len(c.examples)} example(s)" + (f", model {c.model}" if c.model else "")
                + (f", cascade {step_cascade(c)}" if c.cascade else ""))
    value = getattr(step, kind)
    if hasattr(value, "model_dump"):  # a semantic step's settings (llmops.pipeline.semantic_spec)
        value = value.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    return f"{kind}: {value if isinstance(value, str) else json.dumps(value)}"


def plan_pipeline(pipeline: Pipeline, *, limit: int | None = None, use_cache: bool = True,
                  sample_rows: int = 20, estimate: bool = True) -> dict[str, Any]:
    """Validate `pipeline` on at most `sample_rows` source rows and return its plan (no generation). With
    `estimate`, each llm_map step also gets the cost estimate of its job (`llmops.estimate`) over the rows
    reaching it (the first ESTIMATE_ROWS source rows, scaled beyond), and the last one's plan is the
    policy note.
    Raises what `run_pipeline` would raise for the same data (SourceError, StepError, TemplateError)."""
    n = sample_rows if limit is None else min(limit, sample_rows)
    total = count_source_rows(pipeline.source, limit=limit)
    cache = cache_setting(pipeline, use_cache)
    full = read_source(pipeline.source, limit=min(total, ESTIMATE_ROWS)) if estimate else None
    table = full.slice(0, n) if full is not None else read_source(pipeline.source, limit=n)   # the sample: its head
    scale = total / full.num_rows if full is not None and full.num_rows else 1.0
    steps_out: list[dict[str, Any]] = []
    last_map: tuple[LlmMapStep | None, list[Any]] = (None, [])
    last_plan, last_detail = "", None
    for i, step in enumerate(pipeline.steps):
        entry: dict[str, Any] = {"index": i, "kind": step_kind(step), "detail": _describe(step),
                                 "rows_in_sample": None}
        label = step_label(i, step)
        if isinstance(step, LlmMapStep):
            spec = map_spec(step.llm_map, pipeline)
            entry.update(model=spec.model, output_type=str(output_type(spec)),
                         example_prompt=_example_prompt(table, step, label))
            last_map = (step, _sample_prompts(table, step))
            table = _null_outputs(table, step, pipeline)
            if full is not None:
                entry["estimate"] = _estimate(full, step, pipeline, cache, scale, label)
                last_plan = entry["estimate"].pop("plan", "") or last_plan
                last_detail = entry["estimate"].pop("plan_detail", None) or last_detail
                full = _null_outputs(full, step, pipeline)
        elif is_semantic(step):
            table, entry["prompts"] = dry_run_semantic(i, step, table, pipeline)
            full = dry_run_semantic(i, step, full, pipeline)[0] if full is not None else None
        else:
            table = apply_step(i, step, table)
            full = apply_step(i, step, full) if full is not None else None
        entry["rows_in_sample"] = table.num_rows
        steps_out.append(entry)
    llm = [i for i, s in enumerate(pipeline.steps) if isinstance(s, LlmMapStep)]
    streams = bool(llm) and all(isinstance(s, ROW_WISE) for s in pipeline.steps[llm[-1] + 1:])
    writer = SinkWriter(pipeline.sink)
    return {
        "name": pipeline.name, "description": pipeline.description, "model": pipeline.model,
        "engine": {"policy": pipeline.engine.policy, **pipeline.engine.llm_kwargs()},
        "policy_note": last_plan or _policy_preview(pipeline, *last_map, rows=total),
        "job_plan": last_detail,
        "source": {"kind": pipeline.source.kind, "from": getattr(pipeline.source, pipeline.source.kind),
                   "limit": limit, "sample_rows": n},
        "steps": steps_out,
        "output_columns": [c for c in table.column_names if c != ROW_COLUMN],
        "sink": {"kind": pipeline.sink.kind, "target": pipeline.sink.target, "mode": pipeline.sink.mode,
                 "staging": str(writer.staging), "streaming": streams},
        "cache_dir": "disabled" if cache is False else str(cache or default_cache_dir()),
    }


def _indent(text: str, pad: str) -> str:
    return "\n".join(pad + line for line in text.splitlines())


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as readable text (what `llmops run --dry-run` prints)."""
    src, sink = plan["source"], plan["sink"]
    lines = [f"pipeline: {plan['name'] or '(unnamed)'}" + (f" - {plan['description']}" if plan["description"] else ""),
             f"model: {plan['model']}",
             "engine: " + ", ".join(f"{k}={v}" for k, v in plan["engine"].items()),
             f"policy: {plan['engine']['policy']}", _indent(plan["policy_note"], "  "),
             f"source: {src['kind']} {src['from']}" + (f" (limit {src['limit']})" if src["limit"] is not None else ""),
             f"steps (checked on {src['sample_rows']} sample rows):"]
    for s in plan["steps"]:
        detail = "\n       ".join(s["detail"].splitlines())
        lines.append(f"  {s['index']}. {detail}  [{s['rows_in_sample']} sample rows after]")
        est = s.get("estimate")
        if est and "error" in est:
            lines.append(f"     estimate: not available ({est['error']})")
        elif est:
            scaled = f" (scaled from the first {est['scaled_from_rows']} rows)" if est.get("scaled_from_rows") else ""
            speed = (f"{est['predicted_tokens_per_s']:.1f} tok/s predicted, at most {duration(est['seconds_at_most'])}"
                     if est["predicted_tokens_per_s"] else "no speed prediction")
            lines.append(f"     estimate{scaled}: {est['rows']} rows, {est['cached_rows']} cached, {est['deduped_rows']} "
                         f"deduped, {est['null_rows']} null/empty, {est['rows_to_generate']} to generate; "
                         f"~{est['prompt_tokens']} prompt tokens, at most {est['max_generated_tokens']} generated; "
                         f"{speed}")
        if "example_prompt" in s:
            prompt = s["example_prompt"]
            lines.append(f"     output type: {s['output_type']}; example prompt (first sample row):")
            if isinstance(prompt, str):
                lines.append(_indent(prompt, "       "))
            else:
                for m in prompt:
                    lines.append(_indent(f"[{m['role']}] {m['content']}", "       "))
    lines += [f"output columns: {', '.join(plan['output_columns'])}",
              f"sink: {sink['kind']} {sink['target']} ({'streamed' if sink['streaming'] else 'collected'} into "
              f"{sink['staging']}, published at the end)",
              f"result cache: {plan['cache_dir']}",
              "dry run: nothing was generated"]
    return "\n".join(lines)
