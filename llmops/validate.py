"""`validate`: DuckDB rules an LLM step's output must satisfy, and the bounded retry loop around `map_table`.

A rule is a DuckDB boolean expression over the step's input columns and its output column (named as the
step names it; a struct output's fields are `output.field`), e.g. `total > 0 AND currency IN ('USD',
'EUR')`. `run_checked(table, spec, rules=...)` runs the map once over every row, then evaluates the rules
(one DuckDB query for all rows); the rows that fail (a rule false or NULL, or an output that did not parse)
run again with the failure fed back as data: the template gains the previous answer and the rule it broke
(`RETRY_SUFFIX`, its values substituted as data, never as instructions). All retried rows of an attempt are
one `map_table` call. After `max_attempts` a row that still fails keeps a null output and an error naming
the rule and its last output. A rule that DuckDB cannot run (unknown column, syntax) is a job-level
`RuleError` naming the rule and the columns it may use. With a cascade (`llmops.cascade`), every attempt runs
the cascade, and a row whose output breaks a rule goes on to the next model like an unparsable one
(`rule_check`); the retries start from the first model again.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import duckdb
import pyarrow as pa

from llmops.core import CacheDir, Check, Job, MapSpec, map_table, output_type
from llmops.summary import RunSummary

_COLUMNS = ("output", "finish_reason", "error", "text", "confidence", "model", "prompt_tokens", "completion_tokens")
PREVIOUS, FAILURE = "__llmops_previous", "__llmops_failure"
RETRY_SUFFIX = f"\n\nYour previous answer {{{PREVIOUS}}} was rejected: {{{FAILURE}}}. Answer again."


class RuleError(ValueError):
    """A validation rule DuckDB cannot evaluate on this step's columns (a job-level error)."""


def _parsed(sql: str) -> dict[str, Any]:
    con = duckdb.connect()
    try:
        return json.loads(con.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()[0])
    finally:
        con.close()


def _shape(statement: dict[str, Any]) -> dict[str, Any]:
    """A parsed SELECT without its select list (what must equal a bare `SELECT (x) AS ok`)."""
    return {k: v for k, v in statement.get("node", {}).items() if k != "select_list"}


def check_rule_syntax(rule: str) -> str:
    """`rule` when DuckDB parses `SELECT (rule) AS ok` as exactly one expression and nothing more (no second
    column, clause or statement smuggled in through a parenthesis, as in `true) AS ok, (false`); else
    ValueError with DuckDB's complaint or what is wrong."""
    try:
        tree = _parsed(f"SELECT ({rule}) AS ok")
    except duckdb.Error as exc:
        raise ValueError(f"validate rule {rule!r} is not a DuckDB expression: {exc}") from None
    if tree.get("error"):
        raise ValueError(f"validate rule {rule!r} is not a DuckDB expression: {tree.get('error_message')}")
    statements = tree.get("statements", [])
    bare = _parsed("SELECT (NULL) AS ok")["statements"][0]
    if len(statements) != 1 or _shape(statements[0]) != _shape(bare) or \
            len(statements[0]["node"].get("select_list", [])) != 1:
        raise ValueError(f"validate rule {rule!r} is not one DuckDB expression (its parentheses close early, "
                         "adding columns, clauses or statements)")
    return rule


def check_rules(table: pa.Table, rules: Sequence[str], name: str, typ: pa.DataType) -> None:
    """RuleError unless every rule runs on `table`'s columns plus the output column `name` of type `typ`
    (checked on no rows, before any generation)."""
    if not rules:
        return
    empty = table.schema.empty_table()
    if name in empty.column_names:
        empty = empty.drop_columns([name])
    failed_rules(empty.append_column(name, pa.array([], typ)), rules, check=True)


def failed_rules(table: pa.Table, rules: Sequence[str], *, check: bool = False) -> list[str | None]:
    """Per row of `table`: the first rule it fails (false or NULL), or None when it passes all of them. With
    `check`, the rules run even on no rows (RuleError when DuckDB cannot run one)."""
    if not rules or (table.num_rows == 0 and not check):
        return [None] * table.num_rows
    con = duckdb.connect()
    try:
        con.register("checked", table.append_column("__llmops_i", pa.array(range(table.num_rows), pa.int64())))
        tests = ", ".join(f"COALESCE(CAST(({r}) AS BOOLEAN), false)" for r in rules)
        rows = con.sql(f"SELECT {tests} FROM checked ORDER BY __llmops_i").fetchall()
    except duckdb.Error as exc:
        raise RuleError(f"validate rules {list(rules)}: {exc}; columns: {', '.join(table.column_names)}") from None
    finally:
        con.close()
    return [next((rules[k] for k, ok in enumerate(row) if not ok), None) for row in rows]


@dataclass
class Checked:
    """A validated run: `table` has one row per input row, in order (columns `output`, `finish_reason`,
    `error`, `text`, `confidence`, `model`, `prompt_tokens`, `completion_tokens` of the attempt that gave the
    row's answer, and `attempts`: see `llmops.core`); `summary` adds up every attempt;
    `retried` counts rows run again, `rejected` rows still failing after the last attempt."""

    table: pa.Table
    summary: RunSummary = field(default_factory=lambda: RunSummary(calls=0))
    retried: int = 0
    rejected: int = 0


def retry_spec(spec: MapSpec) -> MapSpec:
    """`spec` with the feedback suffix (examples get '-' for the feedback values, as they never failed)."""
    examples = tuple({"input": {**e["input"], PREVIOUS: "-", FAILURE: "-"}, "output": e["output"]}
                     for e in spec.examples)
    return replace(spec, template=spec.template + RETRY_SUFFIX, examples=examples)


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def run_checked(table: pa.Table, spec: MapSpec, *, rules: Sequence[str] = (), max_attempts: int = 2,
                output_name: str = "output", cache_dir: CacheDir = None, progress: bool | None = None,
                engine: Any = None, job: Job | None = None) -> Checked:
    """Run `spec` over `table` with validation and retries (see module docstring). Without rules this is
    one `map_table_ordered` call. `output_name` is what the rules call the output column. `job`: the
    `llmops.core.Job` every attempt is a call of (a Polars expression's, a DuckDB function's; a cascade's
    retries, whose stages run the template they were built with, are jobs of their own; default: a job per
    attempt)."""
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
    kw = {"cache_dir": cache_dir, "progress": progress, "engine": engine,
          "check": rule_check(rules, output_name) if rules and spec.cascade else None}
    check_rules(table, rules, output_name, output_type(spec))
    result, summary = run_map(table, spec, **kw, job=job)
    out = Checked(result.select(list(_COLUMNS)))
    out.summary.add(summary)
    if not rules:
        return _with_attempts(out, [1] * table.num_rows)
    outputs, reasons = result.column("output").to_pylist(), result.column("finish_reason").to_pylist()
    errors, texts = result.column("error").to_pylist(), result.column("text").to_pylist()
    scores, models = result.column("confidence").to_pylist(), result.column("model").to_pylist()
    tokens = [result.column(c).to_pylist() for c in ("prompt_tokens", "completion_tokens")]
    attempts = [1] * table.num_rows
    typ = result.schema.field("output").type
    again, spec2 = _failing(table, outputs, errors, texts, rules, output_name, typ), retry_spec(spec)
    for attempt in range(2, max_attempts + 1):
        if not again:
            break
        rows = sorted(again)
        sub = table.take(rows).append_column(PREVIOUS, pa.array([again[r][0] for r in rows], pa.string()))
        sub = sub.append_column(FAILURE, pa.array([f"it must satisfy {again[r][1]}" for r in rows], pa.string()))
        res, summary = run_map(sub, spec2, **kw, job=None if spec.cascade else job)
        out.summary.add(summary)
        out.retried += len(rows)
        for k, r in enumerate(rows):
            attempts[r] = attempt
            outputs[r], reasons[r] = res.column("output")[k].as_py(), res.column("finish_reason")[k].as_py()
            errors[r], texts[r] = res.column("error")[k].as_py(), res.column("text")[k].as_py()
            scores[r], models[r] = res.column("confidence")[k].as_py(), res.column("model")[k].as_py()
            for column, values in zip(("prompt_tokens", "completion_tokens"), tokens):
                values[r] = res.column(column)[k].as_py()
        again = _failing(table.take(rows), [outputs[r] for r in rows], [errors[r] for r in rows],
                         [texts[r] for r in rows], rules, output_name, typ, offset=rows)
    for r, (shown, rule) in again.items():
        outputs[r], reasons[r], scores[r] = None, "error", None
        errors[r] = f"row {r}: output {shown!r} fails validate rule {rule!r} after {attempts[r]} attempt(s)"
    out.rejected = len(again)
    out.table = pa.table({"output": pa.array(outputs, typ), "finish_reason": pa.array(reasons, pa.string()),
                          "error": pa.array(errors, pa.string()), "text": pa.array(texts, pa.string()),
                          "confidence": pa.array(scores, pa.float64()), "model": pa.array(models, pa.string()),
                          "prompt_tokens": pa.array(tokens[0], pa.int64()),
                          "completion_tokens": pa.array(tokens[1], pa.int64())})
    return _with_attempts(out, attempts)


def _failing(table: pa.Table, outputs: list[Any], errors: list[str | None], texts: list[str | None],
             rules: Sequence[str], name: str, typ: pa.DataType,
             offset: Sequence[int] | None = None) -> dict[int, tuple[str, str]]:
    """{row: (previous answer, the rule it broke)} of rows with an output that fails a rule, or with a
    generated text that did not parse (a row that was never generated is not retried)."""
    rows = list(offset) if offset is not None else list(range(table.num_rows))
    valued = [k for k, v in enumerate(outputs) if v is not None]
    checked = table.take(pa.array(valued, pa.int64()))
    values = pa.array([outputs[k] for k in valued], typ)
    if name in checked.column_names:
        checked = checked.drop_columns([name])
    failed = failed_rules(checked.append_column(name, values), rules) if valued else []
    out = {rows[k]: (_shown(outputs[k]), rule) for k, rule in zip(valued, failed) if rule is not None}
    for k, (v, err, text) in enumerate(zip(outputs, errors, texts)):
        if v is None and err is not None and text:
            out[rows[k]] = (text, "the output must parse: " + err)
    return out


def rule_check(rules: Sequence[str], name: str) -> Check:
    """A cascade's check (`llmops.core.map_table`): per row, whether its output (as column `name` beside the
    row's input columns) breaks one of `rules`."""
    def check(inputs: pa.Table, outputs: pa.Array) -> list[bool]:
        if name in inputs.column_names:
            inputs = inputs.drop_columns([name])
        return [rule is not None for rule in failed_rules(inputs.append_column(name, outputs), rules)]
    return check


def run_map(table: pa.Table, spec: MapSpec, **kw: Any) -> tuple[pa.Table, RunSummary]:
    """`map_table` in row order, with the call's summary (what the pipeline tallies)."""
    run = map_table(table, spec, **kw)
    return run.ordered(), run.summary


def _with_attempts(out: Checked, attempts: list[int]) -> Checked:
    out.table = out.table.append_column("attempts", pa.array(attempts, pa.int64()))
    return out
