"""`llm_extract`: named fields pulled out of a text column, each value a verbatim quote of that text.

The model answers a strict JSON object of string fields (`{field: description}` or a list of names; "" when
the text has no value), one `map_table` job over the column. With `quotes=True` every value must be a span
of its row's text:
- a value found in the text as written is kept; one found ignoring case and runs of whitespace (or without
  surrounding quotes and punctuation) is replaced by the span as the text writes it (`locate`);
- rows with a value that is not in the text get a gleaning round (`llmops.glean`): the model sees its answer
  and which values were not found, and the better answer is kept;
- a value still not in the text becomes null, and `<output>_error` names the field and the value.
So every non-null value is a substring of its source text.

Why checked after decoding and not constrained while decoding: llguidance can constrain a string to the
substrings of a text (a `%regex {"substring_chars": ...}` lexeme in a Lark grammar), but the engine applies
one grammar to every row of a call, and a grammar per row would mean a call per row. A row's answer is
therefore free in its characters and checked, refined and cut back to quotes afterwards.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa

from llmops.glean import Gleaning, run_gleaned
from llmops.semantic.options import Llm
from llmops.semantic.resolve import check_columns

TEXT = "text"
SYSTEM = "You extract information from a text. Copy every value exactly as it is written in the text."
_TRIM = " \t\n\"'`.,;:()[]"


@dataclass
class ExtractReport:
    """Figures of one llm_extract run: rows, values found (non-null), values nulled because they are not a
    quote of their text, rows re-prompted by gleaning."""

    rows: int
    values: int = 0
    not_quotes: int = 0
    gleaned: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def locate(value: str, source: str) -> str | None:
    """The span of `source` that `value` quotes: `value` itself when `source` holds it; else the first span
    equal to it ignoring case and runs of whitespace, or to it without surrounding quotes and punctuation;
    None when there is none. Pure."""
    for candidate in dict.fromkeys((value, value.strip(_TRIM))):
        if candidate and candidate in source:
            return candidate
        tokens = candidate.split()
        if tokens:
            found = re.search(r"\s+".join(re.escape(t) for t in tokens), source, re.IGNORECASE)
            if found:
                return found.group()
    return None


def _fields(fields: Sequence[str] | Mapping[str, str]) -> dict[str, str]:
    named = dict(fields) if isinstance(fields, Mapping) else {f: "" for f in fields}
    if not named:
        raise ValueError("llm_extract: name at least one field")
    for name, about in named.items():
        if not isinstance(name, str) or not name.strip() or not isinstance(about, str):
            raise ValueError(f"llm_extract: fields are names (with an optional description), got {name!r}: {about!r}")
    return named


def extract_template(fields: Mapping[str, str], quotes: bool) -> str:
    """The prompt: the fields (with descriptions), how to answer, then the row's text as data."""
    def literal(text: str) -> str:
        return text.replace("{", "{{").replace("}", "}}")
    lines = "\n".join(literal(f"- {name}" + (f": {about}" if about else "")) for name, about in fields.items())
    how = ("Copy each value exactly as it is written in the text. " if quotes else "") + \
        'Answer "" for a field the text does not give.'
    return f"Extract these fields from the text:\n{lines}\n{how}\n\nText: {{{TEXT}}}"


def _schema(fields: Mapping[str, str]) -> dict[str, Any]:
    return {"type": "object", "properties": {f: {"type": "string"} for f in fields}, "required": list(fields),
            "additionalProperties": False}


def _misquoted(value: Mapping[str, Any] | None, source: str | None) -> list[str]:
    """`field = 'value'` for each non-empty value of `value` that `locate` cannot find in `source`."""
    if value is None or source is None:
        return []
    return [f"{f} = {v!r}" for f, v in value.items() if isinstance(v, str) and v.strip() and locate(v, source) is None]


def llm_extract_table(table: pa.Table, column: str, fields: Sequence[str] | Mapping[str, str], llm: Llm, *,
                      quotes: bool = True, output: str = "extracted",
                      gleaning: int = 1) -> tuple[pa.Table, ExtractReport]:
    """`table` with a struct column `output` (one string field per name; null when the text gives none) and
    `<output>_error` (see module docstring). `gleaning`: refinement rounds for rows with a misquoted value
    (0: none)."""
    named = _fields(fields)
    if isinstance(gleaning, bool) or not isinstance(gleaning, int) or gleaning < 0:
        raise ValueError(f"llm_extract: gleaning must be a number of rounds (0 or more), got {gleaning!r}")
    check_columns(table, [column], "llm_extract.column")
    sources = [None if v is None else str(v) for v in table.column(column).to_pylist()]
    inputs = pa.table({TEXT: pa.array(sources, pa.string())})
    spec = llm.spec(extract_template(named, quotes), schema=_schema(named),
                    system=llm.generation.get("system", SYSTEM),
                    max_new_tokens=llm.generation.get("max_new_tokens", 32 + 48 * len(named)))

    def judge(rows: pa.Table, outputs: pa.Array) -> list[str | None]:
        texts = rows.column(TEXT).to_pylist()
        bad = [_misquoted(v, t) for v, t in zip(outputs.to_pylist(), texts)]
        return [None if not b else "these values are not written in the text: " + "; ".join(b) for b in bad]

    checked = run_gleaned(inputs, spec, gleaning=Gleaning(rounds=gleaning),
                          judge=judge if quotes and gleaning else None, reject=False, cache_dir=llm.cache_dir,
                          progress=llm.progress, engine=llm.engine)
    llm.summary.add(checked.summary)
    report = ExtractReport(rows=table.num_rows, gleaned=checked.retried)
    values, errors = [], []
    for r, (got, err) in enumerate(zip(checked.table.column("output").to_pylist(),
                                       checked.table.column("error").to_pylist())):
        if got is None:
            values.append(None)
            errors.append(err)
            continue
        kept, wrong = {}, []
        for f in named:
            v = got.get(f)
            found = None if not isinstance(v, str) or not v.strip() else locate(v, sources[r]) if quotes else v
            if quotes and found is None and isinstance(v, str) and v.strip():
                wrong.append(f"{f} = {json.dumps(v, ensure_ascii=False)}")
            kept[f] = found
        report.values += sum(v is not None for v in kept.values())
        report.not_quotes += len(wrong)
        values.append(kept)
        errors.append(f"row {r}: not a quote of {column!r}, set to null: {'; '.join(wrong)}" if wrong else None)
    typ = pa.struct([(f, pa.string()) for f in named])
    out = table.drop_columns([c for c in (output, f"{output}_error") if c in table.column_names])
    out = out.append_column(output, pa.array(values, typ))
    return out.append_column(f"{output}_error", pa.array(errors, pa.string())), report
