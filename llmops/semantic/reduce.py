"""`llm_reduce`: one LLM call per group over the group's rows, folded hierarchically when they do not fit.

Each row is rendered with `item` (a `{column}` template, default `- {first column}`; a row with a null in any
of the item's columns is left out, and a group left with no item gets a null output and an error); a group's items,
joined by newlines, fill the `{rows}` placeholder of `template` as one data value (never instructions);
`template` may also name the `by` columns (`"Summarise the {category} tickets:\\n{rows}"`). The output is
like `llm_map`'s: text, `choices`, `regex` or a `schema` (a struct column).

Folding: the budget of one prompt is `max_prompt_tokens` (default: the engine's context minus
`max_new_tokens`). Item and template sizes are counted by the engine's tokenizer when it can
(`engine.prompt_tokens`), else estimated at one token per 3 characters. `pack` cuts a group's items, in
order, into chunks that fit; every chunk of every group is one row of one `map_table` call (a level); the
outputs of a group's chunks become the items of its next level, run with `fold_template` (default:
`template`), until each group fits in one call. A group is done at the level where it fits; `ReduceReport`
counts the calls per level.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from llmops.core import get_engine, output_type, sampling_params
from llmops.semantic.options import Llm
from llmops.semantic.resolve import check_columns
from llmops.templates import TemplateError, check_columns as check_template, render, render_rows, template_fields

ROWS = "rows"
MAX_LEVELS = 8
CHARS_PER_TOKEN = 3


def pack(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Greedy in-order chunks of item indexes whose sizes add up to at most `budget` (an item larger than
    the budget gets a chunk of its own). Pure."""
    chunks: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if chunks and used + size <= budget:
            chunks[-1].append(i)
            used += size
        else:
            chunks.append([i])
            used = size
    return chunks


@dataclass
class ReduceReport:
    """groups: groups reduced; levels: calls (prompts) per level, level 0 first; budget: prompt tokens."""

    groups: int
    budget: int
    levels: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _token_counter(llm: Llm, spec: Any) -> tuple[Any, int | None]:
    """(a function counting the prompt tokens of rendered prompts, the engine's context or None)."""
    eng = llm.engine if llm.engine is not None else get_engine(spec)
    context = getattr(eng, "max_context", None)
    if hasattr(eng, "prompt_tokens"):
        params = sampling_params(spec)
        return (lambda prompts: list(eng.prompt_tokens(prompts, params))), context
    return (lambda prompts: [len(json.dumps(p)) // CHARS_PER_TOKEN + 1 for p in prompts]), context


def _prompts(spec: Any, columns: dict[str, list[Any]], n: int) -> list[Any]:
    return [o.prompt for o in render_rows(spec.template, columns, n, system=spec.system, examples=spec.examples,
                                          on_empty="run")]


def llm_reduce_table(table: pa.Table, by: Sequence[str], template: str, llm: Llm, *, item: str | None = None,
                     output: str = "output", fold_template: str | None = None, max_prompt_tokens: int | None = None,
                     **constraint: Any) -> tuple[pa.Table, ReduceReport]:
    """One row per group of `by` (in order of first appearance): the `by` columns and `output` (see module
    docstring). constraint: schema / choices / regex / max_new_tokens for the output."""
    by = list(by)
    check_columns(table, by, "llm_reduce.by")
    item = item or "- {" + next((c for c in table.column_names if c not in by), table.column_names[0]) + "}"
    check_template(item, table.column_names, what="table (llm_reduce.item)")
    allowed = [ROWS, *by]
    for t in (template, fold_template or template):
        check_template(t, allowed, what="llm_reduce template ({rows} and the `by` columns)")
    if "{" + ROWS + "}" not in template:
        raise TemplateError(f"llm_reduce template {template!r} must contain {{{ROWS}}} (the group's rows)")
    spec = llm.spec(template, **constraint)
    fold = llm.spec(fold_template, **constraint) if fold_template else spec
    count, context = _token_counter(llm, spec)
    budget = max_prompt_tokens or ((context - spec.max_new_tokens) if context else 2048)
    rows = table.to_pylist()
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(tuple(r[c] for c in by), []).append(i)
    keys = list(groups)
    names = template_fields(item)
    items = {k: [render(item, rows[i]) for i in groups[k] if all(rows[i][c] is not None for c in names)]
             for k in keys}   # a row whose item value is null is left out, never rendered as "None"
    report = ReduceReport(groups=len(keys), budget=budget)
    done: dict[tuple, tuple[Any, str | None]] = {
        k: (None, f"group {dict(zip(by, k))}: nothing to reduce (every row's {', '.join(names)} is null)")
        for k in keys if not items[k]}
    level_spec = spec
    for level in range(MAX_LEVELS):
        todo = [k for k in keys if k not in done]
        if not todo:
            break
        chunks = _chunks(todo, items, by, level_spec, count, budget)
        report.levels.append(len(chunks))
        last = level == MAX_LEVELS - 1
        table_in = pa.table({**{c: [k[by.index(c)] for k, _ in chunks] for c in by},
                             ROWS: pa.array(["\n".join(text) for _, text in chunks], pa.string())})
        result = llm.run(table_in, level_spec, output_name=output).table
        outs, errs = result.column("output").to_pylist(), result.column("error").to_pylist()
        per: dict[tuple, list[int]] = {}
        for n, (k, _) in enumerate(chunks):
            per.setdefault(k, []).append(n)
        for k, ns in per.items():
            if len(ns) == 1 or last:
                done[k] = (outs[ns[0]], errs[ns[0]])
            else:
                partial = [outs[n] for n in ns if outs[n] is not None]
                if not partial:
                    done[k] = (None, f"group {dict(zip(by, k))}: every partial reduce failed: {errs[ns[0]]}")
                items[k] = ["- " + (o if isinstance(o, str) else json.dumps(o, ensure_ascii=False)) for o in partial]
        level_spec = fold
    typ = output_type(spec)
    cols = {c: pa.array([k[by.index(c)] for k in keys], table.schema.field(c).type) for c in by}
    out = pa.table({**cols, output: pa.array([done[k][0] for k in keys], typ),
                    f"{output}_error": pa.array([done[k][1] for k in keys], pa.string())})
    return out, report


def _chunks(todo: list[tuple], items: dict[tuple, list[str]], by: list[str], spec: Any, count: Any,
            budget: int) -> list[tuple[tuple, list[str]]]:
    """(group key, item texts) per prompt of this level: each group's items packed to fit `budget`."""
    empty = {c: [k[by.index(c)] for k in todo] for c in by}
    overhead = count(_prompts(spec, {**empty, ROWS: [""] * len(todo)}, len(todo)))
    flat = [(g, text) for g, k in enumerate(todo) for text in items[k]]
    sized = {c: [todo[g][by.index(c)] for g, _ in flat] for c in by}
    sizes = count(_prompts(spec, {**sized, ROWS: [t for _, t in flat]}, len(flat))) if flat else []
    out: list[tuple[tuple, list[str]]] = []
    start = 0
    for g, k in enumerate(todo):
        n = len(items[k])
        own = [max(1, s - overhead[g] + 1) for s in sizes[start:start + n]]  # +1: the joining newline
        for chunk in pack(own, max(1, budget - overhead[g])):
            out.append((k, [items[k][i] for i in chunk]))
        start += n
    return out
