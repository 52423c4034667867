"""Run the semantic steps of a pipeline (`llm_filter`, `llm_reduce`, `resolve`, `llm_join`, the operator steps of
`operator_spec`, and an `llm_map` with `validate` rules or `gleaning`) on the whole current table, through
`llmops.semantic`'s operators.

Each step is one operator call (one job per LLM stage) with the pipeline's model, engine settings and result
cache. `run_semantic(index, step, table, ctx)` returns the new table and a `SemanticFigures` (the step's
summary and the operator's report: pairs compared, groups, levels, retried and rejected rows), which the
runner adds to the run's figures. A problem naming a missing column or a bad rule raises `StepError`
naming the step; a template that does not fit the table raises `TemplateError` naming the step.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pyarrow as pa

from llmops.cascade import as_cascade
from llmops.core import FAILED_EXAMPLES, CacheDir, Completion
from llmops.glean import as_gleaning, rules_judge, run_gleaned
from llmops.pipeline.operator_spec import OPERATOR_STEPS
from llmops.pipeline.operator_steps import run_operator_step
from llmops.pipeline.semantic_spec import (SEMANTIC_STEPS, LlmFilterStep, LlmJoinStep, LlmReduceStep, ResolveStep,
                                           step_config)
from llmops.pipeline.spec import LlmMapStep, Pipeline
from llmops.pipeline.steps import ROW_COLUMN, StepError, attach_output, map_spec, run_sql, step_label
from llmops.report import failure_kind
from llmops.semantic.filter import llm_filter_table
from llmops.semantic.join import llm_join_table
from llmops.semantic.options import Llm
from llmops.semantic.reduce import llm_reduce_table
from llmops.semantic.resolve import resolve_table
from llmops.summary import RunSummary
from llmops.templates import TemplateError
from llmops.validate import RuleError, run_checked


@dataclass
class SemanticFigures:
    """What one semantic step did: `summary` over its LLM calls, `report` the operator's own figures."""

    summary: RunSummary
    report: dict[str, Any] = field(default_factory=dict)


class DryEngine:
    """An engine that generates nothing (`llmops run --dry-run`): every prompt comes back as an error row, so a
    semantic step yields a table of the right columns for the steps after it (texts to embed get no vector);
    `prompts` counts what the step would have sent (before the result cache)."""

    def __init__(self) -> None:
        self.prompts = 0

    def stream(self, prompts: list[Any], params: Any) -> Any:
        self.prompts += len(prompts)
        yield [(i, Completion("", [], "error", 0, error="dry run: nothing generated")) for i in range(len(prompts))]

    def embed(self, texts: list[str]) -> list[Any]:
        self.prompts += len(texts)
        return [SimpleNamespace(vector=None, tokens=0, error="dry run: nothing embedded") for _ in texts]


@dataclass(frozen=True)
class StepContext:
    """The run options a semantic step needs from the pipeline run."""

    pipeline: Pipeline
    cache_dir: CacheDir = None
    progress: bool | None = None
    engine: Any = None


def is_semantic(step: Any) -> bool:
    """Whether `step` runs here (a semantic or operator step, or an llm_map with validate rules or gleaning)."""
    return isinstance(step, SEMANTIC_STEPS + OPERATOR_STEPS) or (
        isinstance(step, LlmMapStep) and bool(step.llm_map.validate_ or step.llm_map.gleaning))


def _llm(cfg: Any, ctx: StepContext) -> Llm:
    return Llm(model=cfg.model or ctx.pipeline.model,
               generation={**cfg.generation(), "engine_settings": ctx.pipeline.engine.llm_kwargs()},
               validate=tuple(cfg.validate_), max_attempts=cfg.max_attempts, cache_dir=ctx.cache_dir,
               progress=ctx.progress, engine=ctx.engine)


def _validated_map(step: LlmMapStep, table: pa.Table, ctx: StepContext) -> tuple[pa.Table, SemanticFigures]:
    cfg = step.llm_map
    spec = map_spec(cfg, ctx.pipeline)
    gleaning = as_gleaning(cfg.gleaning, constrained=True)
    if gleaning is not None:
        judge = rules_judge(cfg.validate_, cfg.output) if cfg.validate_ else None
        result = run_gleaned(table, spec, gleaning=gleaning, judge=judge, cache_dir=ctx.cache_dir,
                             progress=ctx.progress, engine=ctx.engine)
    else:
        result = run_checked(table, spec, rules=cfg.validate_, max_attempts=cfg.max_attempts, output_name=cfg.output,
                             cache_dir=ctx.cache_dir, progress=ctx.progress, engine=ctx.engine)
    rows = result.table.append_column("row", pa.array(range(table.num_rows), pa.int64()))
    out = attach_output(table, rows, cfg).drop_columns([ROW_COLUMN])
    reasons, errors = result.table.column("finish_reason").to_pylist(), result.table.column("error").to_pylist()
    failed = [(i, r, e) for i, (r, e) in enumerate(zip(reasons, errors)) if r is not None and e is not None]
    by_reason = Counter("broke a validate rule" if "validate rule" in e else failure_kind(r, e) for _, r, e in failed)
    return out, SemanticFigures(result.summary, {"retried": result.retried, "rejected": result.rejected,
                                                 "failed_rows": len(failed),
                                                 "failed_examples": [(i, e) for i, _, e in failed[:FAILED_EXAMPLES]],
                                                 "failed_by_reason": dict(by_reason)})


def _operator(step: Any, table: pa.Table, ctx: StepContext) -> tuple[pa.Table, SemanticFigures]:
    if isinstance(step, OPERATOR_STEPS):
        out, summary, report = run_operator_step(step, table, ctx)
        return out, SemanticFigures(summary, report)
    cfg = step_config(step)
    llm = _llm(cfg, ctx)
    if isinstance(step, LlmFilterStep):
        out = llm_filter_table(table, cfg.template, llm, reason_column=cfg.reason)
        report = {"kept": out.num_rows, "dropped": table.num_rows - out.num_rows}
    elif isinstance(step, LlmReduceStep):
        out, rep = llm_reduce_table(table, cfg.by, cfg.template, llm, item=cfg.item, output=cfg.output,
                                    fold_template=cfg.fold_template, max_prompt_tokens=cfg.max_prompt_tokens,
                                    schema=cfg.schema_, choices=tuple(cfg.choices) if cfg.choices else None,
                                    regex=cfg.regex)
        report = rep.to_dict()
    elif isinstance(step, ResolveStep):
        out, rep = resolve_table(table, cfg.columns, llm, blocking=cfg.blocking.blocking(), template=cfg.template,
                                 output=cfg.output, id_column=cfg.id_column)
        report = rep.to_dict()
    elif isinstance(step, LlmJoinStep):
        right = run_sql(cfg.right, pa.table({"_": [None]}), label="llm_join.right")
        out, rep = llm_join_table(table, right, llm, left_on=cfg.left_on, right_on=cfg.right_on,
                                  blocking=cfg.blocking.blocking(), template=cfg.template,
                                  min_confidence=cfg.min_confidence, suffix=cfg.suffix)
        report = rep.to_dict()
    else:
        raise TypeError(f"not a semantic step: {step!r}")
    return out, SemanticFigures(llm.summary, report)


def run_semantic(index: int, step: Any, table: pa.Table, ctx: StepContext) -> tuple[pa.Table, SemanticFigures]:
    """Run semantic step `step` (the pipeline's step `index`) on `table` (see module docstring)."""
    label = step_label(index, step)
    try:
        if isinstance(step, LlmMapStep):
            return _validated_map(step, table, ctx)
        return _operator(step, table, ctx)
    except TemplateError as exc:
        raise TemplateError(f"{label}: {exc}") from None
    except (RuleError, StepError, ValueError) as exc:
        raise StepError(f"{label}: {exc}") from None


def dry_run_semantic(index: int, step: Any, table: pa.Table, pipeline: Pipeline) -> tuple[pa.Table, int]:
    """`run_semantic` without generation or result cache: the step's output columns (empty answers) and the
    number of prompts its LLM stages would send for `table` (the first attempt of each; with a cascade, of
    every model, as if every row went on: an upper bound)."""
    engine = DryEngine()
    cfg = step.llm_map if isinstance(step, LlmMapStep) else step_config(step)
    chain = as_cascade(cfg.cascade, constrained=True)
    given = engine if chain is None else dict.fromkeys(chain.models, engine)
    out, _ = run_semantic(index, step, table, StepContext(pipeline, cache_dir=False, progress=False, engine=given))
    return out, engine.prompts
