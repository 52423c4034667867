"""`split` and `gather`: long documents cut into chunks for per-chunk LLM steps, and put back together (DocETL's
split, then a regrouping of the chunks' results).

`split_table(table, column, chunk_size=..., overlap=..., unit="chars" | "tokens")` replaces each row by one
row per chunk of its `column`: the row's other columns, `doc_id` (the `id_column` value, or the row's index),
`chunk_index` (0, 1, ... in document order) and `chunk` (the text). Consecutive chunks share `overlap` units,
so a sentence cut at a boundary is whole in one of them. In characters, a chunk ends after the last
whitespace of its second half when it has one, and the overlap is widened to start at a word (words stay
whole); in tokens (the model's tokenizer), a
chunk is `chunk_size` tokens decoded back to text (a character split by a boundary is dropped from both
ends). A null or empty text gives one chunk holding null, so no document disappears.

`gather_table(table, by="doc_id", column=...)` puts the per-chunk results back, one row per document (in the
order the documents' first chunks come), in `chunk_index` order: joined with `separator` (values that are not
text as JSON), or, with a `template` (`{rows}` holds the document's chunk results, one per line), reduced by
the model with `llm_reduce` (folded when a document's results do not fit one prompt). Null results are left
out.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import pyarrow as pa

from llmops.core import MapSpec, get_engine
from llmops.semantic.options import Llm
from llmops.semantic.reduce import ReduceReport, llm_reduce_table
from llmops.semantic.resolve import check_columns

Unit = Literal["chars", "tokens"]
DOC_ID, CHUNK_INDEX, CHUNK = "doc_id", "chunk_index", "chunk"


class Tokenizer(Protocol):
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...


def char_chunks(text: str, size: int, overlap: int) -> list[str]:
    """`text` in chunks of at most `size` characters, consecutive ones sharing about `overlap` (see module
    docstring). Pure."""
    out, start = [], 0
    while True:
        end = min(len(text), start + size)
        if end < len(text):
            cut = max(text.rfind(" ", start + size // 2, end), text.rfind("\n", start + size // 2, end))
            end = cut + 1 if cut >= 0 else end
        out.append(text[start:end])
        if end >= len(text):
            return out
        nxt = max(end - overlap, start + 1)
        if overlap and not text[nxt - 1].isspace():        # the overlap starts at a word too (a little longer)
            space = max(text.rfind(" ", start + 1, nxt), text.rfind("\n", start + 1, nxt))
            nxt = space + 1 if space > start else nxt
        start = nxt


def token_chunks(text: str, size: int, overlap: int, tokenizer: Tokenizer) -> list[str]:
    """`text` in chunks of `size` tokens of `tokenizer`, consecutive ones sharing `overlap` tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = []
    for start in range(0, max(1, len(ids) - overlap), size - overlap):
        out.append(tokenizer.decode(ids[start:start + size]).strip("\ufffd"))
    return out


def check_sizes(chunk_size: int, overlap: int, unit: str) -> None:
    """ValueError naming the setting unless 0 <= overlap < chunk_size and unit is chars or tokens."""
    if unit not in ("chars", "tokens"):
        raise ValueError(f"split.unit must be 'chars' or 'tokens', got {unit!r}")
    for name, value in (("chunk_size", chunk_size), ("overlap", overlap)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"split.{name} must be an integer, got {value!r}")
    if chunk_size < 1 or not 0 <= overlap < chunk_size:
        raise ValueError(f"split: need chunk_size >= 1 and 0 <= overlap < chunk_size, got chunk_size={chunk_size}, "
                         f"overlap={overlap}")


def model_tokenizer(llm: Llm) -> Tokenizer:
    """The tokenizer of `llm`'s engine (the one given, else the model's process-wide engine)."""
    eng = llm.engine
    if getattr(eng, "tokenizer", None) is None:
        engine_settings = dict(llm.generation.get("engine_settings") or {})
        eng = get_engine(MapSpec(template="{text}", model=llm.model, engine=tuple(engine_settings.items())))
    if getattr(eng, "tokenizer", None) is None:
        raise ValueError(f"split by tokens needs a tokenizer; model {llm.model!r} has none (use unit: chars)")
    return eng.tokenizer


def split_table(table: pa.Table, column: str, *, chunk_size: int, overlap: int = 0, unit: Unit = "chars",
                id_column: str | None = None, tokenizer: Tokenizer | None = None) -> pa.Table:
    """One row per chunk of `column` (see module docstring); `tokenizer` is needed for unit "tokens"."""
    check_sizes(chunk_size, overlap, unit)
    check_columns(table, [column] + ([id_column] if id_column else []), "split")
    if unit == "tokens" and tokenizer is None and table.num_rows:
        raise ValueError("split by tokens needs the model's tokenizer")
    taken = [c for c in (DOC_ID, CHUNK_INDEX, CHUNK) if c in table.column_names and c != column]
    if taken:
        raise ValueError(f"split: the table already has column(s) {taken}; rename them first")
    rows, index, chunks = [], [], []
    for r, text in enumerate(table.column(column).to_pylist()):
        if text is None or not str(text).strip():
            parts: list[str | None] = [None]
        elif unit == "chars":
            parts = list(char_chunks(str(text), chunk_size, overlap))
        else:
            parts = list(token_chunks(str(text), chunk_size, overlap, tokenizer))   # type: ignore[arg-type]
        rows += [r] * len(parts)
        index += range(len(parts))
        chunks += parts
    take = pa.array(rows, pa.int64())
    ids = table.column(id_column).take(take) if id_column else take
    columns = {c: table.column(c).take(take) for c in table.column_names if c != column}
    return pa.table({**columns, DOC_ID: ids, CHUNK_INDEX: pa.array(index, pa.int64()),
                     CHUNK: pa.array(chunks, pa.string())})


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def gather_table(table: pa.Table, column: str, *, by: str | Sequence[str] = DOC_ID, order: str = CHUNK_INDEX,
                 output: str | None = None, separator: str = "\n", template: str | None = None,
                 llm: Llm | None = None, **constraint: Any) -> tuple[pa.Table, ReduceReport | None]:
    """One row per document (`by`), its chunks' `column` values put back in `order` (see module docstring):
    the `by` columns and `output` (default `column`), with a template also `<output>_error`."""
    by = [by] if isinstance(by, str) else list(by)
    check_columns(table, [*by, order, column], "gather")
    output = output or column
    ordered = table.sort_by([(order, "ascending")]) if table.num_rows else table    # stable: documents keep their order
    if template is not None:
        if llm is None:
            raise ValueError("gather with a template needs the model settings (llm)")
        return llm_reduce_table(ordered, by, template, llm, item="{" + column + "}", output=output, **constraint)
    keys: dict[tuple, list[str]] = {}
    for row in ordered.select([*by, column]).to_pylist():
        values = keys.setdefault(tuple(row[c] for c in by), [])
        if row[column] is not None:
            values.append(_text(row[column]))
    cols = {c: pa.array([k[i] for k in keys], table.schema.field(c).type) for i, c in enumerate(by)}
    joined = [separator.join(v) if v else None for v in keys.values()]
    return pa.table({**cols, output: pa.array(joined, pa.string())}), None
