"""Pairwise LLM comparison of records, shared by `resolve` and `llm_join`: candidate pairs -> one table of
pair prompts -> one `map_table` job -> a Same/Different decision per pair.

A pair table has columns `left` and `right` (each record rendered as `column: value; ...` over the compared
columns) and `left_<column>` / `right_<column>` for each compared column, so a custom template may name
either (`"A: {left_title} ({left_price})\\nB: {right_title} ({right_price})\\nSame or Different?"`). Every
value enters the prompt as data. The answer is constrained to `choices=("Same", "Different")`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from llmops.semantic.options import Llm

SAME, DIFFERENT = "Same", "Different"
SYSTEM = "Decide whether two records describe the same real-world entity. Answer Same or Different."
TEMPLATE = "Record A: {left}\nRecord B: {right}\nSame or Different?"


def render_record(row: Mapping[str, Any], columns: Sequence[str]) -> str:
    """`column: value; ...` of a row's non-null compared columns (one column: its bare value)."""
    if len(columns) == 1:
        value = row.get(columns[0])
        return "" if value is None else str(value)
    return "; ".join(f"{c}: {row[c]}" for c in columns if row.get(c) is not None)


def pair_table(left: list[dict[str, Any]], right: list[dict[str, Any]], pairs: Sequence[tuple[int, int]],
               left_columns: Sequence[str], right_columns: Sequence[str]) -> pa.Table:
    """One row per pair (i, j): `left`/`right` renderings and `left_<c>`/`right_<c>` values (as text)."""
    cols: dict[str, list[str | None]] = {"left": [render_record(left[i], left_columns) for i, _ in pairs],
                                         "right": [render_record(right[j], right_columns) for _, j in pairs]}
    for side, rows, names, pick in (("left", left, left_columns, 0), ("right", right, right_columns, 1)):
        for c in names:
            cols[f"{side}_{c}"] = [None if rows[p[pick]].get(c) is None else str(rows[p[pick]][c]) for p in pairs]
    return pa.table({k: pa.array(v, pa.string()) for k, v in cols.items()})


def compare_pairs(pairs_table: pa.Table, llm: Llm, *, template: str | None = None) -> list[bool | None]:
    """The model's decision per row of `pairs_table`: True (Same), False (Different), None (no answer)."""
    spec = llm.spec(template or TEMPLATE, choices=(SAME, DIFFERENT), system=llm.generation.get("system", SYSTEM),
                    max_new_tokens=llm.generation.get("max_new_tokens", 4))
    outputs = llm.run(pairs_table, spec, output_name="decision").table.column("output").to_pylist()
    return [None if o is None else o == SAME for o in outputs]
