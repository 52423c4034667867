"""`resolve`: entity resolution within one table: blocking -> LLM pairwise comparison -> clusters.

1. Blocking (`llmops.semantic.blocking`): candidate pairs from exact keys (`blocking.keys`) and q-gram
   similarity of the compared columns' values (`on`; `blocking_text`, no column names), or with an
   `EmbeddingBlocking` their embedding neighbours (`llmops.semantic.embed_blocking`), never all n(n-1)/2 pairs.
2. Comparison (`llmops.semantic.compare`): every candidate pair is one row of a pair table, and the whole
   table is one `map_table` job (dedup and the result cache apply; identical pairs run once).
3. Clusters (`llmops.semantic.components.clusters`): the pairs the model calls Same are merged, most similar
   first, unless the merge would put a pair the model called Different into one entity (a chain of Same
   answers never overrides a Different one). The output column (`output`, default `entity_id`) holds the
   `id_column` value of the entity's first row (its smallest row index), or that row index when no
   `id_column` is given; an `id_column` must be unique and non-null (checked before any work).

`ResolveReport` says how much blocking saved: all pairs, candidate pairs, pairs the model was asked about
(candidates whose records both rendered to something), matched pairs, matched pairs left apart because of a
Different answer (`cut_pairs`), entities.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa

from llmops.semantic.blocking import Blocking, blocking_text
from llmops.semantic.compare import compare_pairs, pair_table
from llmops.semantic.components import clusters
from llmops.semantic.embed_blocking import AnyBlocking, pairs_for
from llmops.semantic.options import Llm


@dataclass
class ResolveReport:
    """Figures of one resolve run (see module docstring)."""

    rows: int
    all_pairs: int
    candidate_pairs: int
    compared_pairs: int
    matched_pairs: int
    entities: int
    failed_pairs: int = 0
    cut_pairs: int = 0

    @property
    def reduction(self) -> float:
        """Share of all pairs that were not compared."""
        return 1 - self.compared_pairs / self.all_pairs if self.all_pairs else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "reduction": round(self.reduction, 4)}


def check_columns(table: pa.Table, columns: Sequence[str], what: str) -> None:
    """ValueError naming `what` and the missing columns when `table` lacks any of `columns`."""
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ValueError(f"{what}: unknown column(s) {missing}; columns: {', '.join(table.column_names)}")


def check_unique(table: pa.Table, column: str) -> None:
    """ValueError naming the rows unless every value of `column` is non-null and distinct (an id column:
    an entity is named by its first row's id, so a repeated id would merge unrelated entities)."""
    first: dict[str, int] = {}
    for i, value in enumerate(table.column(column).to_pylist()):
        if value is None:
            raise ValueError(f"resolve.id_column {column!r} is null at row {i}; it must identify every row")
        key = repr(value)
        if key in first:
            raise ValueError(f"resolve.id_column {column!r} is not unique: {value!r} is on rows {first[key]} and "
                             f"{i}; name a column that identifies each row, or leave id_column out (row numbers)")
        first[key] = i


def resolve_table(table: pa.Table, on: str | Sequence[str], llm: Llm, *, blocking: AnyBlocking = Blocking(),
                  template: str | None = None, output: str = "entity_id",
                  id_column: str | None = None) -> tuple[pa.Table, ResolveReport]:
    """`table` with an entity id column (see module docstring) and the run's report."""
    on = [on] if isinstance(on, str) else list(on)
    if not on:
        raise ValueError("resolve: `on` must name at least one column to compare")
    check_columns(table, on, "resolve.on")
    check_columns(table, blocking.keys, "resolve.blocking.keys")
    if id_column is not None:
        check_columns(table, [id_column], "resolve.id_column")
        check_unique(table, id_column)
    rows = table.select(list(dict.fromkeys([*on, *blocking.keys]))).to_pylist()
    texts = [blocking_text(r, on) for r in rows]
    candidates = pairs_for(blocking, texts, [[r[k] for r in rows] for k in blocking.keys], llm)
    pairs = sorted(p for p in candidates if texts[p[0]] and texts[p[1]])
    same = compare_pairs(pair_table(rows, rows, pairs, on, on), llm, template=template) if pairs else []
    matched = sorted((p for p, s in zip(pairs, same) if s), key=lambda p: (-candidates[p], p))   # best first
    labels = clusters(table.num_rows, matched, [p for p, s in zip(pairs, same) if s is False])
    ids: Any = labels if id_column is None else [table.column(id_column)[i].as_py() for i in labels]
    typ = pa.int64() if id_column is None else table.schema.field(id_column).type
    column = pa.array(ids, typ)
    out = table.drop_columns([output]) if output in table.column_names else table
    n = table.num_rows
    report = ResolveReport(rows=n, all_pairs=n * (n - 1) // 2, candidate_pairs=len(candidates),
                           compared_pairs=len(pairs), matched_pairs=len(matched), entities=len(set(labels)),
                           failed_pairs=sum(s is None for s in same),
                           cut_pairs=sum(labels[a] != labels[b] for a, b in matched))
    return out.append_column(output, column), report
