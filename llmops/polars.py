"""Polars adapter: `llm_map(template, ...) -> pl.Expr`, usable in select/with_columns, eager, lazy, streaming.

The template's placeholders become the expression's inputs (`pl.struct` of those columns, or of the
expressions given in `columns`), and an elementwise `map_batches` runs `llmops.core.map_table_ordered`
with an explicit `return_dtype`, so Polars never calls it on dummy data. An expression is one job
(`llmops.core.Job`): every call it gets plans nothing new and finds the executor warm, and
`llmops.last_summary()` adds up all of them. Eager frames and `group_by().agg` hand it the whole column in
one call; the streaming engine (`collect(engine="streaming")`, `sink_parquet`, `collect_batches`) hands it
morsels (a parquet scan's row groups, or `pl.Config.set_streaming_chunk_size` rows), so results reach the
sink morsel by morsel while the job runs. Morsels arriving together on Polars' threads are merged into
one engine run of up to `llmops.coalesce.COALESCE_BLOCKS` of the plan's blocks, in arrival order. An
ordered sink (`maintain_order=True`, Polars' default) passes a morsel on only after every earlier one, and
a UDF is not told which morsel is first, so first results arrive early only by luck there:
`sink_batches(..., maintain_order=False)` or `sink_parquet(..., maintain_order=False)` get each morsel as
it finishes. One expression never generates twice for one input: the last few inputs and outputs are
kept and a repeated call with an equal input returns the kept output (Polars may call a UDF twice, e.g.
with `.struct.unnest()`, pola-rs/polars#20260); across evaluations the result cache serves repeats.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import polars as pl
import pyarrow as pa

from llmops import coalesce
from llmops.core import Job, MapSpec, map_table_ordered, output_type
from llmops.glean import Gleaning, as_gleaning, rules_judge, run_gleaned
from llmops.templates import template_fields
from llmops.validate import check_rule_syntax, run_checked

_MEMO = 8             # (input, output) pairs an expression keeps to answer Polars' repeated calls
_META = ("output", "finish_reason", "error", "text", "prompt_tokens", "completion_tokens", "confidence", "model")


def polars_dtype(arrow: pa.DataType) -> pl.DataType:
    """The Polars dtype Polars gives an Arrow array of type `arrow`."""
    return pl.Series(pa.array([], type=arrow)).dtype


class _MapBatches:
    """The UDF of one `llm_map` expression: owns the spec, the job, and the last few (input, output) pairs."""

    def __init__(self, spec: MapSpec, dtype: pl.DataType, meta: bool, cache_dir: Any, progress: bool | None,
                 engine: Any, rules: tuple[str, ...] = (), max_attempts: int = 2,
                 gleaning: Gleaning | None = None) -> None:
        self.spec, self.dtype, self.meta = spec, dtype, meta
        self.rules, self.max_attempts, self.gleaning = rules, max_attempts, gleaning
        self.kw = {"cache_dir": cache_dir, "progress": progress}
        self.job = Job(spec, engine=engine)
        self._coalescer = coalesce.for_job(self.job, self._run)
        self._lock = threading.Lock()
        self._memo: list[tuple[pl.Series, pl.Series]] = []
        self.generations = 0

    def __call__(self, inputs: pl.Series) -> pl.Series:
        if inputs.len() == 0:
            return pl.Series(inputs.name, [], dtype=self.dtype)
        with self._lock:
            for seen, out in self._memo:
                if seen.len() == inputs.len() and seen.equals(inputs):
                    return out
        result = self._coalescer(inputs.struct.unnest().to_arrow())
        if self.meta:
            arr = pa.StructArray.from_arrays([result.column(n).combine_chunks() for n in _META], names=_META)
        else:
            arr = result.column("output").combine_chunks()
        out = pl.Series(inputs.name, arr).cast(self.dtype)
        with self._lock:
            self._memo = [*self._memo[-(_MEMO - 1):], (inputs, out)]
        return out

    def _run(self, table: pa.Table) -> pa.Table:
        self.generations += 1
        if self.gleaning is not None:
            judge = rules_judge(self.rules, "output") if self.rules else None
            return run_gleaned(table, self.spec, gleaning=self.gleaning, judge=judge, job=self.job, **self.kw).table
        if self.rules:
            return run_checked(table, self.spec, rules=self.rules, max_attempts=self.max_attempts, job=self.job,
                               **self.kw).table
        return map_table_ordered(table, self.spec, job=self.job, **self.kw)


def _declared_dtype(schema: Any) -> pl.DataType | None:
    """The Struct dtype a schema given in Polars terms asks for (so `pl.Int32` stays Int32), else None."""
    if isinstance(schema, pl.Struct):
        return schema
    if isinstance(schema, pl.Schema):
        return pl.Struct(dict(schema))
    if isinstance(schema, Mapping) and schema and all(
            isinstance(v, pl.DataType) or (isinstance(v, type) and issubclass(v, pl.DataType)) for v in schema.values()):
        return pl.Struct(dict(schema))
    return None


def llm_map(template: str, *, model: str = "smollm2-135m-instruct", schema: Any = None,
            choices: Sequence[str] | None = None, regex: str | None = None, system: str | None = None,
            examples: Sequence[Mapping[str, Any]] | None = None, max_new_tokens: int = 64,
            temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
            stop: Sequence[str] = (), chat: bool | None = None, engine_settings: Mapping[str, Any] | None = None,
            on_long_prompt: Literal["error", "truncate"] = "error", columns: Mapping[str, str | pl.Expr] | None = None,
            on_empty: Literal["null", "error", "run"] = "null",
            cascade: Sequence[str] | Mapping[str, Any] | None = None, min_confidence: float | None = None,
            validate: str | Sequence[str] = (), max_attempts: int = 2,
            gleaning: int | Mapping[str, Any] | None = None, with_meta: bool = False,
            cache_dir: str | Path | None | Literal[False] = None,
            progress: bool | None = None, engine: Any = None) -> pl.Expr:
    """An expression generating one value per row from `template` (see `llmops.core.MapSpec` for the
    generation arguments). Output dtype: String, `pl.Enum(choices)` for choices, or a Struct matching
    `schema`; named `default_name(spec)` unless aliased; with `with_meta=True` a
    Struct {output, finish_reason, error, text, prompt_tokens, completion_tokens, confidence, model} (error:
    why output is null; text: the raw generated text; confidence: how sure the model was of a constrained
    output, `engine.decoding.confidence`; model: the model that answered the row, see `llmops.core`). Null
    in any placeholder column -> null.
    `cascade=["smollm2-135m-instruct", "qwen2.5-0.5b-instruct"], min_confidence=0.9`: every row runs on the
    first model, and the rows it was unsure of (confidence below min_confidence) or got wrong (an error, an
    output that does not parse) run again on the next; the cascade replaces `model` and each model is one job
    (`llmops.cascade`). `columns` binds placeholder names to other columns or expressions (default
    `pl.col(name)`). `engine` is an object with the `engine.LLM` API (default: the process-wide engine for
    `model`); with a cascade, a mapping {model: engine} (models left out get the process-wide one).
    `validate`: DuckDB rules (one or a list, `llmops.validate`) over the placeholders and `output` (a struct
    output's fields are `output.field`), e.g. `"output.total > 0"`; a row whose output breaks one runs again
    with the failure fed back, at most `max_attempts` times in all, then gets a null output and an error
    naming the rule (a rule DuckDB cannot run raises `llmops.validate.RuleError` when the query runs).
    `gleaning=1` (or `{"rounds": 1, "min_confidence": 0.8}`): refinement rounds for the rows whose output is
    invalid (unparsable, breaking a `validate` rule) or unsure (confidence below min_confidence): each is
    re-prompted with its previous answer and why it failed, and keeps the better answer (`llmops.glean`);
    with `validate`, the rounds replace `max_attempts`.
    Template errors (bad syntax) raise here; unknown columns raise Polars' ColumnNotFoundError (naming
    the column and listing the frame's columns) when the query runs, before any generation."""
    spec = MapSpec(template=template, model=model, system=system, examples=tuple(examples or ()), schema=schema,
                   choices=choices, regex=regex,
                   max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                   stop=stop, chat=chat, engine=tuple((engine_settings or {}).items()),
                   on_long_prompt=on_long_prompt, on_empty=on_empty, cascade=cascade or (),
                   min_confidence=min_confidence)
    rules = (validate,) if isinstance(validate, str) else tuple(validate)
    for rule in rules:
        check_rule_syntax(rule)
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
    glean = as_gleaning(gleaning, constrained=schema is not None or choices is not None or regex is not None)
    if glean is not None and max_attempts != 2:
        raise ValueError("give gleaning rounds or max_attempts, not both (gleaning's rounds are the retries)")
    names = template_fields(template)
    if not names:
        raise ValueError(f"template {template!r} has no {{column}} placeholder: nothing to map over")
    bound = dict(columns or {})
    unknown = sorted(set(bound) - set(names))
    if unknown:
        raise ValueError(f"columns {unknown} are not placeholders of template {template!r} (placeholders: {list(names)})")
    exprs = [(pl.col(bound[n]) if isinstance(bound.get(n), str) else bound.get(n, pl.col(n))).alias(n) for n in names]
    out = output_type(spec)
    if with_meta:
        out = pa.struct([("output", out), ("finish_reason", pa.string()), ("error", pa.string()),
                         ("text", pa.string()), ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
                         ("confidence", pa.float64()), ("model", pa.string())])
    declared = None if with_meta else _declared_dtype(schema)
    dtype = declared if declared is not None else polars_dtype(out)
    if spec.choices is not None:   # choices come back as pl.Enum of exactly those categories
        enum = pl.Enum(list(dict.fromkeys(spec.choices)))
        dtype = pl.Struct({**dict(dtype), "output": enum}) if with_meta else enum
    udf = _MapBatches(spec, dtype, with_meta, cache_dir, progress, engine, rules, max_attempts, glean)
    return pl.struct(exprs).map_batches(udf, return_dtype=dtype, is_elementwise=True).alias(default_name(spec))


def default_name(spec: MapSpec) -> str:
    """The output name of an unaliased `llm_map`: `llm_map_<first placeholder>_<6 hex digits of the spec>`,
    so two different maps in one `with_columns` never collide (`.alias(...)` names it yourself)."""
    digest = hashlib.sha1(json.dumps(spec.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:6]
    first = template_fields(spec.template)[0]
    return f"llm_map_{first}_{digest}"
