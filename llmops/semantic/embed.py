"""Embeddings as columns and the joins they allow: `embed` (a vector per row) and `sim_join` (cosine similarity
join, LOTUS's sim_join).

`embed_table(table, column, llm)` adds a `list<float32>` column: the engine's embedding of each row's text
(`llmops.core.embed_texts` -> `engine.LLM.embed`: a forward pass of the model `llm` names, the mean of its last
hidden states, unit length), with `<output>_error` saying why a row has none (null text: null, no error).
Identical texts are embedded once, all rows in one engine call.

`sim_join_table(left, right, llm, left_on=..., right_on=..., k=..., threshold=...)` embeds both sides in one
call and keeps, for each left row, its `k` most similar right rows and/or those with cosine similarity at or
above `threshold` (at least one of the two), best first: the left row's columns, the right row's (suffixed
where a name is taken) and `similarity`. Similarities are exact dot products, computed in chunks of left rows
(`nearest`): quadratic in the rows, which a CPU does in seconds up to tens of thousands of rows a side.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
import numpy as np
import pyarrow as pa

from llmops.core import embed_texts
from llmops.semantic.options import Llm

CHUNK_ROWS = 512     # left rows whose similarities to every right row are computed at once
EMBEDDING = pa.list_(pa.float32())


def _check(table: pa.Table, columns: Sequence[str], what: str) -> None:
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ValueError(f"{what}: unknown column(s) {missing}; columns: {', '.join(table.column_names)}")


def row_texts(table: pa.Table, columns: Sequence[str]) -> list[str | None]:
    """Per row: its non-null values of `columns`, space-separated (None when all are null)."""
    rows = table.select(list(columns)).to_pylist()
    texts = [" ".join(str(r[c]) for c in columns if r[c] is not None) for r in rows]
    return [t if t else None for t in texts]


def embed_values(texts: Sequence[str | None], llm: Llm) -> tuple[list[list[float] | None], list[str | None]]:
    """(vector, error) per text through `llmops.core.embed_texts` with `llm`'s model, engine settings and
    engine."""
    engine = llm.engine
    if isinstance(engine, Mapping):         # a cascade's engines: its models' first one embeds
        engine = engine.get(llm.model, next(iter(engine.values()), None))
    return embed_texts(texts, model=llm.model, engine_settings=llm.generation.get("engine_settings"), engine=engine)


def embed_table(table: pa.Table, column: str | Sequence[str], llm: Llm, *, output: str = "embedding") -> pa.Table:
    """`table` with the embedding of `column` (or of several columns' values joined) in `output` and why a row
    has none in `<output>_error` (see module docstring)."""
    columns = [column] if isinstance(column, str) else list(column)
    _check(table, columns, "embed")
    vectors, errors = embed_values(row_texts(table, columns), llm)
    errors = [None if e is None else f"row {i}: {e}" for i, e in enumerate(errors)]
    out = table.drop_columns([c for c in (output, f"{output}_error") if c in table.column_names])
    out = out.append_column(output, pa.array(vectors, EMBEDDING))
    return out.append_column(f"{output}_error", pa.array(errors, pa.string()))


def matrix(vectors: Sequence[list[float] | None]) -> tuple[np.ndarray, np.ndarray]:
    """(float32 [n, h] with zero rows for missing vectors, bool [n] which rows have one)."""
    have = np.array([v is not None for v in vectors], dtype=bool)
    width = next((len(v) for v in vectors if v is not None), 0)
    out = np.zeros((len(vectors), width), dtype=np.float32)
    for i, v in enumerate(vectors):
        if v is not None:
            out[i] = v
    return out, have


def nearest(left: np.ndarray, right: np.ndarray, *, k: int | None, threshold: float | None,
            skip_self: bool = False) -> Iterator[tuple[int, int, float]]:
    """(i, j, cosine) for each left row i: its `k` most similar right rows (all with k None) at or above
    `threshold` (any with None), best first. `skip_self`: left and right are one table; i is never paired with
    itself. Rows of zeros (no vector) match nothing. Pure."""
    if not len(left) or not len(right):
        return
    have = np.abs(right).sum(1) > 0                                     # [m]
    for start in range(0, len(left), CHUNK_ROWS):
        sims = left[start:start + CHUNK_ROWS] @ right.T                  # [c, m]
        sims[:, ~have] = -np.inf
        if skip_self:
            rows = np.arange(sims.shape[0])
            sims[rows, rows + start] = -np.inf
        for r, row in enumerate(sims):
            if not np.abs(left[start + r]).sum():
                continue
            if k is not None and k < len(row):
                idx = np.argpartition(-row, k - 1)[:k]
            else:
                idx = np.arange(len(row))
            idx = idx[np.argsort(-row[idx], kind="stable")]
            for j in idx:
                score = float(row[j])
                if score == -np.inf or (threshold is not None and score < threshold):
                    break
                yield start + r, int(j), score


def sim_join_table(left: pa.Table, right: pa.Table, llm: Llm, *, left_on: str | Sequence[str],
                   right_on: str | Sequence[str] | None = None, k: int | None = None, threshold: float | None = None,
                   suffix: str = "_right", similarity: str = "similarity") -> pa.Table:
    """Pairs of `left` and `right` rows by embedding similarity (see module docstring)."""
    lcols = [left_on] if isinstance(left_on, str) else list(left_on)
    rcols = lcols if right_on is None else [right_on] if isinstance(right_on, str) else list(right_on)
    if k is None and threshold is None:
        raise ValueError("sim_join: give k (nearest rows per left row) or threshold (a minimum cosine similarity)")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"sim_join: k must be a positive integer, got {k!r}")
    if threshold is not None and not -1 <= threshold <= 1:
        raise ValueError(f"sim_join: threshold is a cosine similarity in [-1, 1], got {threshold!r}")
    _check(left, lcols, "sim_join (left)")
    _check(right, rcols, "sim_join (right)")
    ltexts, rtexts = row_texts(left, lcols), row_texts(right, rcols)
    vectors, _ = embed_values(ltexts + rtexts, llm)
    lmat, _ = matrix(vectors[:len(ltexts)])
    rmat, _ = matrix(vectors[len(ltexts):])
    if lmat.shape[1] != rmat.shape[1]:
        lmat, rmat = lmat[:, :0], rmat[:, :0]
    found = list(nearest(lmat, rmat, k=k, threshold=threshold))
    out = left.take(pa.array([i for i, _, _ in found], pa.int64()))
    taken = right.take(pa.array([j for _, j, _ in found], pa.int64()))
    for name, col in zip(right.column_names, taken.columns):
        out = out.append_column(f"{name}{suffix}" if name in left.column_names else name, col)
    return out.append_column(similarity, pa.array([s for _, _, s in found], pa.float64()))
