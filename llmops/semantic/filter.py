"""`llm_filter`: keep the rows of a table for which the model answers Yes to a `{column}` template.

Decide, then explain. The decision is constrained (`choices=("Yes", "No")`), so every finished row is a
boolean, and all rows run as one `map_table` job (dedup, result cache). With a reason, a second job asks for
one sentence on why the answer given is right (the template, then the answer as data: `EXPLAIN_SUFFIX`), for
the rows that need one (the kept rows in `llm_filter_table`). Asking for a reason therefore never changes a
decision: the first job is the very job a filter without a reason runs (a small model asked for
`{"answer", "reason"}` at once answers differently, and a reason cut by max_new_tokens would lose the
answer). A row whose answer is null (a null input, an error) is dropped and counted in `dropped_errors`; a
row whose explanation failed keeps a null reason.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import pyarrow as pa

from llmops.semantic.options import Llm

YES, NO = "Yes", "No"
SYSTEM = "Answer the question about the record with Yes or No."
EXPLAIN_SYSTEM = ("The question about the record has been answered. Give the reason in one short sentence, "
                  "from the record.")
ANSWER = "__llmops_answer"
EXPLAIN_SUFFIX = f"\n\nAnswer: {{{ANSWER}}}\nReason:"


@dataclass(frozen=True)
class FilterResult:
    """keep: per input row True / False / None (no answer); reasons: per row (None without `reason`, and
    for rows not explained); errors: per row, why there is no answer."""

    keep: list[bool | None]
    reasons: list[str | None] | None
    errors: list[str | None]

    @property
    def dropped_errors(self) -> int:
        return sum(k is None for k in self.keep)


def llm_filter_decisions(table: pa.Table, template: str, llm: Llm, *, reason: bool = False) -> FilterResult:
    """The model's Yes/No per row of `table` for `template`, and with `reason` why, for every answered row
    (see module docstring)."""
    spec = llm.spec(template, choices=(YES, NO), system=llm.generation.get("system", SYSTEM),
                    max_new_tokens=llm.generation.get("max_new_tokens", 4))
    result = llm.run(table, spec, output_name="answer").table
    keep = [None if a is None else a == YES for a in result.column("output").to_pylist()]
    reasons = explain(table, template, llm, keep, [i for i, k in enumerate(keep) if k is not None]) \
        if reason else None
    return FilterResult(keep, reasons, result.column("error").to_pylist())


def explain(table: pa.Table, template: str, llm: Llm, keep: Sequence[bool | None],
            rows: Sequence[int]) -> list[str | None]:
    """Per row of `table`: the model's one-sentence reason for its answer `keep[i]` on the `rows` listed (one
    job; free text, no validation rules), None elsewhere."""
    out: list[str | None] = [None] * table.num_rows
    if not rows:
        return out
    sub = table.take(pa.array(rows, pa.int64()))
    sub = sub.append_column(ANSWER, pa.array([YES if keep[i] else NO for i in rows], pa.string()))
    llm = _free_text(llm)
    spec = llm.spec(template + EXPLAIN_SUFFIX, system=EXPLAIN_SYSTEM, examples=(),
                    max_new_tokens=llm.generation.get("max_new_tokens", 64))
    texts = llm.run(sub, spec, output_name="reason").table.column("output").to_pylist()
    for i, text in zip(rows, texts):
        out[i] = None if text is None else text.strip()
    return out


def _free_text(llm: Llm) -> Llm:
    """`llm` for a free-text answer: no validation rules (they speak of the decision), a cascade's models
    without its confidence threshold (free text has no confidence; each row stops at the first model)."""
    generation = {k: v for k, v in llm.generation.items() if k != "min_confidence"}
    cascade = generation.get("cascade")
    if isinstance(cascade, Mapping):
        generation["cascade"] = cascade.get("models")
    return replace(llm, validate=(), generation=generation)


def llm_filter_table(table: pa.Table, template: str, llm: Llm, *, reason_column: str | None = None) -> pa.Table:
    """The rows of `table` the model keeps, in order, with the model's reason in `reason_column` if named."""
    result = llm_filter_decisions(table, template, llm)
    rows = [i for i, k in enumerate(result.keep) if k]
    out = table.take(pa.array(rows, pa.int64()))
    if reason_column is not None:
        reasons = explain(table, template, llm, result.keep, rows)
        if reason_column in out.column_names:
            out = out.drop_columns([reason_column])
        out = out.append_column(reason_column, pa.array([reasons[i] for i in rows], pa.string()))
    return out
