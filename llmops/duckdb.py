"""DuckDB adapter: LLM generation as SQL functions (Arrow UDFs) and as a whole-relation operation.

`register(con)` creates `llm_map(template, value)`: `value` is one value (bound to the template's single
placeholder) or a struct whose fields the placeholders name (`llm_map('{a} and {b}', {'a': x, 'b': y})`); with
one placeholder a struct names it only when its fields are exactly that name (`{'a': x}`), so any other
STRUCT or JSON value (even one with a field called like the placeholder) renders as its JSON text.
It returns VARCHAR (an `ENUM` of the choices for `choices=`, or the schema's STRUCT). `register(con, name="extract_invoice", template=...,
schema=...)` creates a typed function whose arguments are the template's placeholders in order of first
appearance. Both are SQL macros over one Arrow UDF that receives `to_json(value)`, so any argument type
works (DuckDB Python UDFs cannot be overloaded nor take ANY). NULL in (or a NULL struct field) gives
NULL out; per-row failures give NULL (the error is counted in `llmops.last_summary()`); template errors
raise. `side_effects` is set when sampling (temperature > 0).

DuckDB calls the UDF once per 2048-row chunk. A registered function is one job per template
(`llmops.core.Job`): its first chunk plans the engine's policy and every later chunk, of this query or the
next, reuses the plan and the warm executor; `llmops.last_summary()` adds up all of its chunks (register
the function again to start a new job). Chunks DuckDB evaluates on several threads at once are merged
into engine runs of a few of the plan's blocks (`llmops.coalesce`). DuckDB holds a Python UDF's results
until the query ends unless it may reorder them: with `SET preserve_insertion_order = false` (and more
than one thread) an Arrow reader over the query gets each chunk as it finishes. `map_relation(con, query,
template)` runs a whole query's rows as one engine call instead (larger blocks for large tables) and
returns a relation once every row is done.
"""
from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import duckdb
import pyarrow as pa

from llmops import coalesce
from llmops.core import Job, MapSpec, check_choices, map_table_ordered
from llmops.structured import arrow_type, to_json_schema
from llmops.templates import TemplateError, template_fields
from llmops.validate import check_rule_syntax, run_checked

_META = ("finish_reason", "error", "text", "prompt_tokens", "completion_tokens", "confidence", "model")


def duckdb_type(typ: pa.DataType) -> str:
    """The DuckDB SQL type string of Arrow type `typ` (the types `llmops.structured.arrow_type` makes)."""
    if pa.types.is_struct(typ):
        inner = ", ".join(f'"{f.name}" {duckdb_type(f.type)}' for f in typ)
        return f"STRUCT({inner})"
    if pa.types.is_list(typ):
        return f"{duckdb_type(typ.value_type)}[]"
    simple = {pa.string(): "VARCHAR", pa.int64(): "BIGINT", pa.float64(): "DOUBLE", pa.bool_(): "BOOLEAN"}
    if typ not in simple:
        raise TypeError(f"no DuckDB type for Arrow type {typ}")
    return simple[typ]


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def enum_type(choices: Sequence[str]) -> str:
    """The DuckDB `ENUM('a', 'b')` type of a choices list (duplicates dropped, order kept)."""
    return "ENUM(" + ", ".join("'" + c.replace("'", "''") + "'" for c in dict.fromkeys(choices)) + ")"


def _spec_kwargs(model: str, schema: Any, choices: Sequence[str] | None, kw: Mapping[str, Any]) -> dict[str, Any]:
    settings = kw.pop("engine_settings", None) or {}
    examples = kw.pop("examples", None) or ()
    return {"model": model, "schema": schema, "choices": None if choices is None else check_choices(choices),
            "examples": tuple(examples), "engine": tuple(settings.items()), "stop": kw.pop("stop", ()), **kw}


class _Udf:
    """The Arrow UDF behind one registered function: owns a job per template seen (and its coalescer)."""

    def __init__(self, template: str | None, spec_kwargs: dict[str, Any], run_kwargs: dict[str, Any],
                 engine: Any, rules: tuple[str, ...] = (), max_attempts: int = 2) -> None:
        self.template, self.spec_kwargs, self.run_kwargs, self.engine = template, spec_kwargs, run_kwargs, engine
        self.rules, self.max_attempts = rules, max_attempts
        self._specs: dict[str, MapSpec] = {}
        self._jobs: dict[str, tuple[Job, coalesce.Coalescer]] = {}
        self._lock = threading.Lock()
        schema = spec_kwargs.get("schema")
        self.out_type = arrow_type(to_json_schema(schema)) if schema is not None else pa.string()

    def spec(self, template: str) -> MapSpec:
        with self._lock:
            if template not in self._specs:
                self._specs[template] = MapSpec(template=template, **self.spec_kwargs)
            return self._specs[template]

    def job(self, template: str) -> tuple[Job, coalesce.Coalescer]:
        """The job of `template` and the coalescer that merges its concurrent chunks."""
        spec = self.spec(template)
        with self._lock:
            if template not in self._jobs:
                job = Job(spec, engine=self.engine)
                self._jobs[template] = (job, coalesce.for_job(job, lambda table: self._map(table, spec, job)))
            return self._jobs[template]

    def _map(self, table: pa.Table, spec: MapSpec, job: Job) -> pa.Table:
        """One chunk's rows of `job`, validated and retried when there are rules."""
        if self.rules:
            return run_checked(table, spec, rules=self.rules, max_attempts=self.max_attempts, job=job,
                               **self.run_kwargs).table
        return map_table_ordered(table, spec, job=job, **self.run_kwargs)

    def __call__(self, *args: pa.ChunkedArray) -> pa.Array:
        if self.template is None:
            templates, values = args[0].to_pylist(), args[1].to_pylist()
        else:
            values = args[0].to_pylist()
            templates = [self.template] * len(values)
        out: list[Any] = [None] * len(values)
        by_template: dict[str, list[int]] = {}
        for i, t in enumerate(templates):
            if t is None:
                raise TemplateError(f"llm_map: the template argument is NULL at row {i} of this chunk")
            by_template.setdefault(t, []).append(i)
        for template, rows in by_template.items():
            result = self._run(template, [values[i] for i in rows])
            for i, v in zip(rows, result.column("output").to_pylist()):
                out[i] = v
        return pa.array(out, type=self.out_type)

    def _run(self, template: str, values: list[str | None]) -> pa.Table:
        names = template_fields(template)
        decoded = [None if v is None else json.loads(v) for v in values]
        columns: dict[str, list[Any]] = {n: [] for n in names}
        for v in decoded:
            fields = v if isinstance(v, dict) and (len(names) != 1 or set(v) == set(names)) else None
            if fields is None and v is not None and len(names) != 1:
                raise TemplateError(f"llm_map: template {template!r} has {len(names)} placeholders "
                                    f"{list(names)}; pass a struct naming them, e.g. {{'{names[0] if names else 'x'}': col}}")
            if fields is not None and len(names) and not set(names) <= set(fields):
                missing = [n for n in names if n not in fields]
                raise TemplateError(f"llm_map: template {template!r} uses {missing} which the struct does not "
                                    f"have; available fields: {', '.join(fields)}")
            for n in names:
                cell = None if v is None else (fields[n] if fields is not None else v)
                columns[n].append(cell if cell is None or isinstance(cell, str) else
                                  json.dumps(cell, ensure_ascii=False) if isinstance(cell, (dict, list)) else str(cell))
        table = pa.table({n: pa.array(c, pa.string()) for n, c in columns.items()}) if names \
            else pa.table({"_": pa.array(values, pa.string())})
        return self.job(template)[1](table)


def register(con: duckdb.DuckDBPyConnection, *, name: str = "llm_map", template: str | None = None,
             model: str = "smollm2-135m-instruct", schema: Any = None, choices: Sequence[str] | None = None,
             cache_dir: str | Path | None | Literal[False] = None, progress: bool | None = False,
             engine: Any = None, validate: str | Sequence[str] = (), max_attempts: int = 2,
             **generation: Any) -> str:
    """Create SQL function `name` on `con` (see module docstring); returns `name`.

    generation: the other `MapSpec` fields (system, examples, regex, max_new_tokens, temperature, top_p,
    top_k, seed, stop, chat, on_long_prompt, on_empty, cascade, min_confidence) and `engine_settings` (dict for
    `engine.LLM`). engine: an object with the `engine.LLM` API (default: the process-wide engine for `model`).
    `cascade=[small, large], min_confidence=0.9` answers each row with the first model sure enough of it
    (`llmops.cascade`: one job per model per template; it replaces `model`, and `engine` is then a mapping
    {model: engine}). `validate`: DuckDB rules (one or a list, `llmops.validate`) over the template's
    placeholders and `output`; a row that breaks one runs again with the failure fed back (within its chunk),
    at most `max_attempts` times in all, then gives NULL (its error counted in `llmops.last_summary()`)."""
    rules = (validate,) if isinstance(validate, str) else tuple(validate)
    for rule in rules:
        check_rule_syntax(rule)
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"function name {name!r} must be a plain SQL identifier")
    spec_kwargs = _spec_kwargs(model, schema, choices, dict(generation))
    if template is not None:
        MapSpec(template=template, **spec_kwargs)
    udf = _Udf(template, spec_kwargs, {"cache_dir": cache_dir, "progress": progress}, engine, rules, max_attempts)
    impl = f"__llmops_{name}_impl"
    ret = duckdb_type(udf.out_type)
    side_effects = float(spec_kwargs.get("temperature", 0.0)) > 0
    params = ["VARCHAR"] if template is not None else ["VARCHAR", "VARCHAR"]
    try:
        con.remove_function(impl)
    except duckdb.InvalidInputException:
        pass
    if template is None:
        def function(template: pa.ChunkedArray, value: pa.ChunkedArray) -> pa.Array:
            return udf(template, value)
    else:
        def function(value: pa.ChunkedArray) -> pa.Array:  # type: ignore[misc]
            return udf(value)
    con.create_function(impl, function, params, ret, type="arrow", null_handling="special", side_effects=side_effects)
    cast = f" AS {enum_type(choices)})" if choices is not None else ""   # choices: an ENUM column
    if template is None:
        con.execute(f"CREATE OR REPLACE MACRO {name}(template, value) AS "
                    f"{'CAST(' if cast else ''}{impl}(template, CAST(to_json(value) AS VARCHAR)){cast}")
    else:
        args = template_fields(template)
        if not args:
            raise TemplateError(f"template {template!r} has no placeholder: a typed function needs arguments")
        pack = ", ".join(f"'{a.replace(chr(39), chr(39) * 2)}': {_quote(a)}" for a in args)
        con.execute(f"CREATE OR REPLACE MACRO {name}({', '.join(_quote(a) for a in args)}) AS "
                    f"{'CAST(' if cast else ''}{impl}(CASE WHEN {' OR '.join(f'{_quote(a)} IS NULL' for a in args)} "
                    f"THEN NULL ELSE CAST(to_json({{{pack}}}) AS VARCHAR) END){cast}")
    return name


def map_relation(con: duckdb.DuckDBPyConnection, query: str | duckdb.DuckDBPyRelation, template: str, *,
                 output: str = "llm_output", with_meta: bool = False, model: str = "smollm2-135m-instruct",
                 schema: Any = None, choices: Sequence[str] | None = None,
                 cache_dir: str | Path | None | Literal[False] = None, progress: bool | None = None,
                 engine: Any = None, **generation: Any) -> duckdb.DuckDBPyRelation:
    """Run `template` over every row of `query` (SQL text or a relation) as one job; return a relation of
    the query's columns plus `output` (and finish_reason/error/text/token/confidence/model columns when
    `with_meta`, see `llmops.core`); `cascade` and `min_confidence` as `register`.
    Placeholders name the query's columns (TemplateError listing them otherwise)."""
    rel = con.sql(query) if isinstance(query, str) else query
    table = rel.to_arrow_table()
    spec = MapSpec(template=template, **_spec_kwargs(model, schema, choices, dict(generation)))
    result = map_table_ordered(table, spec, cache_dir=cache_dir, progress=progress, engine=engine)
    table = table.append_column(output, result.column("output"))
    if with_meta:
        for col in _META:
            table = table.append_column(col, result.column(col))
    rel = con.from_arrow(table)
    if spec.choices is not None:   # choices: an ENUM column
        rel = rel.project(f"* REPLACE (CAST({_quote(output)} AS {enum_type(spec.choices)}) AS {_quote(output)})")
    return rel
