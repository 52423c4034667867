"""Semantic blocking for `resolve` and `llm_join`: candidate pairs from embedding similarity instead of q-grams.

`blocking="embedding"` (or `EmbeddingBlocking(top_k=..., threshold=..., keys=...)`) embeds every record's
blocking text (its compared values, as `llmops.semantic.blocking.blocking_text`) in one engine call and keeps
each record's `top_k` nearest records (cosine similarity, `llmops.semantic.embed.nearest`) at or above
`threshold`, plus the pairs equal on any exact `keys` (score 1.0). It finds pairs that share meaning but few
characters ("NYC" ~ "New York City") where q-grams find none; it costs one forward pass per distinct record
and n x m dot products. `pairs_for` / `cross_pairs_for` give the candidates of either kind of blocking, so an
operator takes both.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmops.semantic.blocking import Blocking, candidate_pairs, cross_candidate_pairs, key_pairs
from llmops.semantic.embed import embed_values, matrix, nearest
from llmops.semantic.options import Llm


@dataclass(frozen=True)
class EmbeddingBlocking:
    """keys: exact-key columns (any one equal -> pair); top_k: nearest records kept per record; threshold:
    minimum cosine similarity (None: the top_k alone decide); model: the embedding model (None: the operator's)."""

    keys: tuple[str, ...] = ()
    top_k: int = 10
    threshold: float | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(self.keys))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"blocking.top_k must be a positive integer, got {self.top_k!r}")
        if self.threshold is not None and not -1 <= self.threshold <= 1:
            raise ValueError(f"blocking.threshold is a cosine similarity in [-1, 1], got {self.threshold!r}")


AnyBlocking = Blocking | EmbeddingBlocking


def as_blocking(value: AnyBlocking | Mapping[str, Any] | str | None) -> AnyBlocking:
    """A blocking from what an operator is given: None (q-grams, the defaults), "embedding" or "qgram", a
    `Blocking` / `EmbeddingBlocking`, or a mapping of fields (with `method: embedding` for embeddings)."""
    if value is None or value == "qgram":
        return Blocking()
    if value == "embedding":
        return EmbeddingBlocking()
    if isinstance(value, (Blocking, EmbeddingBlocking)):
        return value
    if isinstance(value, Mapping):
        fields = dict(value)
        method = fields.pop("method", "qgram")
        if method not in ("qgram", "embedding"):
            raise ValueError(f"blocking.method must be 'qgram' or 'embedding', got {method!r}")
        return EmbeddingBlocking(**fields) if method == "embedding" else Blocking(**fields)
    raise ValueError(f"blocking must be 'qgram', 'embedding', a mapping of its settings or a Blocking, got {value!r}")


def _embedded(texts: Sequence[str], llm: Llm, blocking: EmbeddingBlocking) -> Any:
    use = llm if blocking.model is None else Llm(model=blocking.model, generation=llm.generation, engine=None)
    vectors, _ = embed_values([t or None for t in texts], use)
    return matrix(vectors)[0]


def pairs_for(blocking: AnyBlocking, texts: Sequence[str], keys: Sequence[Sequence[Hashable | None]],
              llm: Llm) -> dict[tuple[int, int], float]:
    """Candidate pairs (i < j) within one table: `llmops.semantic.blocking.candidate_pairs` for q-grams, else the
    embedding neighbours (see module docstring) and the key pairs."""
    if isinstance(blocking, Blocking):
        return candidate_pairs(texts, keys, blocking)
    vectors = _embedded(texts, llm, blocking)
    out: dict[tuple[int, int], float] = {}
    for i, j, score in nearest(vectors, vectors, k=blocking.top_k, threshold=blocking.threshold, skip_self=True):
        pair = (min(i, j), max(i, j))
        out[pair] = max(out.get(pair, score), score)
    for column in keys:
        out.update({p: 1.0 for p in key_pairs(column)})
    return out


def cross_pairs_for(blocking: AnyBlocking, left: Sequence[str], right: Sequence[str],
                    keys: Sequence[tuple[Sequence[Hashable | None], Sequence[Hashable | None]]],
                    llm: Llm) -> dict[tuple[int, int], float]:
    """Candidate pairs (i in left, j in right): `cross_candidate_pairs` for q-grams, else each left record's
    embedding neighbours among the right records, each right record's among the left, and the key pairs."""
    if isinstance(blocking, Blocking):
        return cross_candidate_pairs(left, right, keys, blocking)
    vectors = _embedded(list(left) + list(right), llm, blocking)
    lvec, rvec = vectors[:len(left)], vectors[len(left):]
    out: dict[tuple[int, int], float] = {}
    for i, j, score in nearest(lvec, rvec, k=blocking.top_k, threshold=blocking.threshold):
        out[(i, j)] = score
    for j, i, score in nearest(rvec, lvec, k=blocking.top_k, threshold=blocking.threshold):
        out[(i, j)] = score
    for lkeys, rkeys in keys:
        joined = list(lkeys) + list(rkeys)
        n = len(lkeys)
        out.update({(a, b - n): 1.0 for a, b in key_pairs(joined) if a < n <= b})
    return out
