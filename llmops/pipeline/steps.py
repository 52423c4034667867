"""The table steps of a pipeline (sql, filter, dedupe, parse, select) and the glue around `llm_map`.

Table steps run on DuckDB over the current Arrow table registered as `input` (insertion order is kept,
so row order survives filters and casts). `llm_map` turns its step config into a `MapSpec` for
`llmops.core.map_table`; `attach_output` joins a batch of results back onto the input rows. A step that
fails (unknown column, SQL error) raises `StepError` naming the step's index and kind.
"""
from __future__ import annotations

from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from llmops.core import MapSpec
from llmops.pipeline.sources import quote_ident
from llmops.pipeline.spec import (DedupeStep, FilterStep, LlmMap, ParseStep, Pipeline, SelectStep, SqlStep,
                                  duckdb_type, step_kind)

ROW_COLUMN = "__llmops_row"  # position of a row in the table given to the last llm_map (sink order)


class StepError(ValueError):
    """A step cannot run on the current table (a job-level error naming the step)."""


def step_label(index: int, step: Any) -> str:
    return f"steps[{index}] ({step_kind(step)})"


def run_sql(sql: str, table: pa.Table, *, label: str) -> pa.Table:
    """Run DuckDB `sql` with `table` registered as `input`; return the result as Arrow."""
    con = duckdb.connect()
    try:
        con.register("input", table)
        return con.sql(sql).to_arrow_table()
    except duckdb.Error as exc:
        raise StepError(f"{label}: {exc}; columns of input: {', '.join(table.column_names)}") from None
    finally:
        con.close()


def step_sql(step: Any, *, keep: tuple[str, ...] = ()) -> str:
    """The DuckDB query over `input` for a sql/filter/parse/select step; `keep` names extra columns a
    select must carry through (the hidden row column)."""
    if isinstance(step, SqlStep):
        return step.sql.strip().rstrip(";")
    if isinstance(step, FilterStep):
        return f"SELECT * FROM input WHERE ({step.filter})"
    if isinstance(step, ParseStep):
        casts = ", ".join(f"TRY_CAST({quote_ident(c)} AS {duckdb_type(t)}) AS {quote_ident(c)}"
                          for c, t in step.parse.items())
        return f"SELECT * REPLACE ({casts}) FROM input" if casts else "SELECT * FROM input"
    if isinstance(step, SelectStep):
        if isinstance(step.select, list):
            cols = [quote_ident(c) for c in step.select]
            names = set(step.select)
        else:
            cols = [f"({expr}) AS {quote_ident(new)}" for new, expr in step.select.items()]
            names = set(step.select)
        cols += [quote_ident(k) for k in keep if k not in names]
        return f"SELECT {', '.join(cols)} FROM input"
    raise TypeError(f"no SQL for step {step!r}")


def dedupe(table: pa.Table, columns: list[str], *, label: str) -> pa.Table:
    """The first row of each distinct key (`columns`, or all columns when empty), in input order."""
    keys = columns or [c for c in table.column_names if c != ROW_COLUMN]
    missing = [c for c in keys if c not in table.column_names]
    if missing:
        raise StepError(f"{label}: unknown column(s) {missing}; columns of input: {', '.join(table.column_names)}")
    idx = "__llmops_dedupe_idx"
    indexed = table.select(keys).append_column(idx, pa.array(range(table.num_rows), pa.int64()))
    try:
        firsts = indexed.group_by(keys, use_threads=False).aggregate([(idx, "min")])[f"{idx}_min"]
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid) as exc:
        raise StepError(f"{label}: cannot dedupe on {keys}: {exc}") from None
    return table.take(pc.take(firsts, pc.sort_indices(firsts)))


def apply_step(index: int, step: Any, table: pa.Table, *, keep: tuple[str, ...] = ()) -> pa.Table:
    """Run one table step (anything but llm_map) on `table`."""
    label = step_label(index, step)
    if isinstance(step, DedupeStep):
        return dedupe(table, step.dedupe, label=label)
    return run_sql(step_sql(step, keep=keep), table, label=label)


def map_spec(cfg: LlmMap, pipeline: Pipeline) -> MapSpec:
    """The `MapSpec` of an llm_map step (its model or cascade, else the pipeline's model; the pipeline's
    engine settings)."""
    return MapSpec(
        template=cfg.template, model=cfg.model or pipeline.model, system=cfg.system,
        examples=tuple({"input": e.input, "output": e.output} for e in cfg.examples), schema=cfg.schema_,
        choices=tuple(cfg.choices) if cfg.choices is not None else None, regex=cfg.regex,
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        seed=cfg.seed, stop=tuple(cfg.stop), chat=cfg.chat, engine=pipeline.engine.llm_kwargs(),
        on_long_prompt=cfg.on_long_prompt, on_empty=cfg.on_empty, cascade=cfg.cascade or (),
        min_confidence=cfg.min_confidence)


def _set_column(table: pa.Table, name: str, values: pa.Array | pa.ChunkedArray) -> pa.Table:
    if name in table.column_names:
        return table.set_column(table.column_names.index(name), name, values)
    return table.append_column(name, values)


def row_errors(batch: pa.RecordBatch | pa.Table) -> pa.Array:
    """Why each row's output is null (the map's `error` column, see llmops.core); null for good rows."""
    return batch.column(batch.schema.get_field_index("error"))


def attach_output(table: pa.Table, batch: pa.RecordBatch | pa.Table, cfg: LlmMap) -> pa.Table:
    """The rows of `table` named by `batch["row"]` with the step's output column(s) set (a struct
    unnested into one column per field when `cfg.unnest`), the error, model and confidence columns when asked,
    and the hidden `ROW_COLUMN` (the row's index in `table`) unless the table already carries one."""
    rows = batch.column(batch.schema.get_field_index("row"))
    out = table.take(rows)
    output = batch.column(batch.schema.get_field_index("output"))
    if cfg.unnest:
        prefix = cfg.unnest if isinstance(cfg.unnest, str) else ""
        struct_type = output.type
        for i in range(struct_type.num_fields):
            field = struct_type.field(i)
            out = _set_column(out, f"{prefix}{field.name}", pc.struct_field(output, [i]))
    else:
        out = _set_column(out, cfg.output, output)
    if cfg.error_column:
        out = _set_column(out, cfg.error_column, row_errors(batch))
    for name, column in ((cfg.model_column, "model"), (cfg.confidence_column, "confidence")):
        if name:
            out = _set_column(out, name, batch.column(batch.schema.get_field_index(column)))
    if ROW_COLUMN not in out.column_names:
        out = out.append_column(ROW_COLUMN, pc.cast(rows, pa.int64()))
    return out
