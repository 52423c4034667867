"""Check a pipeline against its data's columns before any work, so every error comes before the first row.

`check_pipeline(pipeline)` reads the source's columns (no rows: DuckDB still infers a CSV's types from a
sample) and runs every step on that empty table: table steps' SQL binds against the columns that reach them,
each llm_map's template names columns that exist at its step (a second step's `{nonexistent}` fails here,
not after the first step generated), unnested fields must not overwrite an input column, `validate` rules
must run on the step's columns and output, and semantic steps run with an engine that generates nothing.
It raises what the run would raise later (SourceError, StepError, TemplateError), naming the step.
"""
from __future__ import annotations

import pyarrow as pa

from llmops.core import output_schema, output_type
from llmops.pipeline.semantic_steps import dry_run_semantic, is_semantic
from llmops.pipeline.sources import SourceError, read_source
from llmops.pipeline.spec import RESERVED_PREFIX, LlmMapStep, Pipeline
from llmops.pipeline.steps import ROW_COLUMN, StepError, apply_step, attach_output, map_spec, step_label
from llmops.templates import TemplateError, check_columns
from llmops.validate import RuleError, check_rules


def _llm_map(index: int, step: LlmMapStep, table: pa.Table, pipeline: Pipeline) -> pa.Table:
    """The columns after an llm_map step (null outputs), once its template, unnested fields and rules fit."""
    cfg, label = step.llm_map, step_label(index, step)
    try:
        check_columns(cfg.template, table.column_names)
    except TemplateError as exc:
        raise TemplateError(f"{label}: {exc}") from None
    clash = [c for c in cfg.written_columns() if c in table.column_names] if cfg.unnest else []
    if clash:
        raise StepError(f"{label}: unnested field(s) {clash} would overwrite the input column(s) of the same "
                        "name; give `unnest` a prefix (unnest: \"out_\") or rename the column before this step")
    spec = map_spec(cfg, pipeline)
    if cfg.validate_:
        try:
            check_rules(table, cfg.validate_, cfg.output, output_type(spec))
        except RuleError as exc:
            raise StepError(f"{label}: {exc}") from None
    return attach_output(table, output_schema(spec).empty_table(), cfg).drop_columns([ROW_COLUMN])


def _reserved(table: pa.Table, where: str, error: type[ValueError]) -> None:
    names = [c for c in table.column_names if c.startswith(RESERVED_PREFIX)]
    if names:
        raise error(f"{where}: column(s) {names} use the reserved prefix {RESERVED_PREFIX!r} (the runner's own "
                    "hidden columns); rename them")


def check_pipeline(pipeline: Pipeline) -> None:
    """Run every step of `pipeline` on its source's columns with no rows (see module docstring)."""
    table = read_source(pipeline.source, limit=0)
    _reserved(table, f"source.{pipeline.source.kind}", SourceError)
    for index, step in enumerate(pipeline.steps):
        if isinstance(step, LlmMapStep):
            table = _llm_map(index, step, table, pipeline)
        elif is_semantic(step):
            table = dry_run_semantic(index, step, table, pipeline)[0]
        else:
            table = apply_step(index, step, table)
        _reserved(table, step_label(index, step), StepError)
