"""`llm_filter`: keep the rows of a table for which the model answers Yes to a `{column}` template.

The answer is constrained (`choices=("Yes", "No")`, or with a reason the JSON schema `{"answer": "Yes" |
"No", "reason": string}`), so every finished row is a boolean; all rows run as one `map_table` job (dedup,
result cache). A row whose answer is null (a null input, an error) is dropped and counted in `dropped_errors`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from llmops.semantic.options import Llm

YES, NO = "Yes", "No"
SYSTEM = "Answer the question about the record with Yes or No."
REASON_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": [YES, NO]},
                                                  "reason": {"type": "string"}},
                 "required": ["answer", "reason"], "additionalProperties": False}


@dataclass(frozen=True)
class FilterResult:
    """keep: per input row True / False / None (no answer); reasons: per row (None without `reason`);
    errors: per row, why there is no answer."""

    keep: list[bool | None]
    reasons: list[str | None] | None
    errors: list[str | None]

    @property
    def dropped_errors(self) -> int:
        return sum(k is None for k in self.keep)


def llm_filter_decisions(table: pa.Table, template: str, llm: Llm, *, reason: bool = False) -> FilterResult:
    """The model's Yes/No per row of `table` for `template` (see module docstring)."""
    gen: dict[str, Any] = {"system": llm.generation.get("system", SYSTEM)}
    if reason:
        spec = llm.spec(template, schema=REASON_SCHEMA, max_new_tokens=llm.generation.get("max_new_tokens", 64), **gen)
    else:
        spec = llm.spec(template, choices=(YES, NO), max_new_tokens=llm.generation.get("max_new_tokens", 4), **gen)
    result = llm.run(table, spec, output_name="answer").table
    outputs = result.column("output").to_pylist()
    answers = [o["answer"] if isinstance(o, dict) else o for o in outputs]
    keep = [None if a is None else a == YES for a in answers]
    reasons = [o["reason"] if isinstance(o, dict) else None for o in outputs] if reason else None
    return FilterResult(keep, reasons, result.column("error").to_pylist())


def llm_filter_table(table: pa.Table, template: str, llm: Llm, *, reason_column: str | None = None) -> pa.Table:
    """The rows of `table` the model keeps, in order, with the model's reason in `reason_column` if named."""
    result = llm_filter_decisions(table, template, llm, reason=reason_column is not None)
    rows = [i for i, k in enumerate(result.keep) if k]
    out = table.take(pa.array(rows, pa.int64()))
    if reason_column is not None and result.reasons is not None:
        if reason_column in out.column_names:
            out = out.drop_columns([reason_column])
        out = out.append_column(reason_column, pa.array([result.reasons[i] for i in rows], pa.string()))
    return out
