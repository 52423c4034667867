"""Blocking: which pairs of records are worth an LLM comparison (pure functions, no model, no I/O).

Comparing every pair of n records costs n(n-1)/2 LLM calls; blocking keeps the pairs that could match:
- exact keys: records whose normalized key (e.g. a phone, an email, a postcode) is equal;
- character similarity: records sharing enough character q-grams. A record's blocking text is its compared
  values alone (`blocking_text`: no column names, which every record would share and which would make every
  pair look alike). Each record becomes the set of q-grams of its normalized tokens (lower case, punctuation
  dropped, every token padded with spaces: "noah" -> " no", "noa", "oah", "ah "), so word order does not
  matter ("O'Brien, Noah" ~ "Noah O'Brien"). An inverted index from q-gram to records finds the records that
  share q-grams without visiting all pairs; a q-gram held by more than `max_posting` records (" th", "the")
  is skipped as carrying no signal. A pair is kept when its Jaccard similarity |A & B| / |A | B| reaches
  `threshold`, at most `top_k` best per record. The threshold is a floor on every pair's score whatever the
  table's size (`max_posting` only saves work on large tables).

Why our own q-gram index and not rapidfuzz or DuckDB's `jaro_winkler_similarity`: both score a pair they
are given, so blocking with them still enumerates all n(n-1)/2 pairs (rapidfuzz's `cdist` does it fast, in
C, but quadratically); the inverted index only visits pairs that share a q-gram, and it needs no new
dependency. `pair_recall` measures what blocking loses against the brute-force pair set.
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_NON_WORD = re.compile(r"[^\w]+")


@dataclass(frozen=True)
class Blocking:
    """How candidate pairs are chosen. keys: exact-key blocking on these columns (any one equal -> pair);
    q: q-gram length; threshold: minimum Jaccard similarity of q-gram sets (None: no similarity blocking);
    top_k: most similar partners kept per record; max_posting: q-grams held by more records are ignored."""

    keys: tuple[str, ...] = ()
    q: int = 3
    threshold: float | None = 0.35
    top_k: int = 10
    max_posting: int = 200

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(self.keys))
        if self.q < 1:
            raise ValueError(f"blocking.q must be at least 1, got {self.q}")
        if self.threshold is not None and not 0 <= self.threshold <= 1:
            raise ValueError(f"blocking.threshold must be in [0, 1], got {self.threshold}")
        if self.top_k < 1 or self.max_posting < 2:
            raise ValueError("blocking.top_k must be at least 1 and blocking.max_posting at least 2")
        if self.threshold is None and not self.keys:
            raise ValueError("blocking needs keys or a similarity threshold (else every pair is a candidate)")


def blocking_text(row: Mapping[str, Any], columns: Sequence[str]) -> str:
    """The text a record is blocked on: its non-null values of `columns`, space-separated, no column names."""
    return " ".join(str(row[c]) for c in columns if row.get(c) is not None)


def normalize(text: str) -> str:
    """Lower case, punctuation and underscores as spaces, whitespace collapsed."""
    return " ".join(_NON_WORD.sub(" ", text.lower()).replace("_", " ").split())


def qgrams(text: str, q: int = 3) -> frozenset[str]:
    """The q-grams of each normalized token, padded with one space each side (order-free)."""
    grams: set[str] = set()
    for token in normalize(text).split():
        padded = f" {token} "
        if len(padded) <= q:
            grams.add(padded)
        grams.update(padded[i:i + q] for i in range(len(padded) - q + 1))
    return frozenset(grams)


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    """|a & b| / |a | b| (0 for two empty sets)."""
    union = len(a | b)
    return len(a & b) / union if union else 0.0


def key_pairs(keys: Sequence[Hashable | None]) -> set[tuple[int, int]]:
    """Pairs (i < j) of records with equal non-null keys (strings compared normalized)."""
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        if key is None:
            continue
        key = normalize(key) if isinstance(key, str) else key
        if key != "":
            groups[key].append(i)
    return {(a, b) for rows in groups.values() for x, a in enumerate(rows) for b in rows[x + 1:]}


def _index(sets: Sequence[frozenset[str]]) -> dict[str, list[int]]:
    index: dict[str, list[int]] = defaultdict(list)
    for i, grams in enumerate(sets):
        for g in grams:
            index[g].append(i)
    return index


def similar_pairs(left: Sequence[str], right: Sequence[str] | None = None, *, q: int = 3, threshold: float = 0.35,
                  top_k: int = 10, max_posting: int = 200) -> dict[tuple[int, int], float]:
    """{(i, j): Jaccard similarity} of the pairs at or above `threshold` found through the q-gram index, at
    most `top_k` best per record of either side. right None: pairs within `left` (i < j); else (i in left,
    j in right)."""
    lsets = [qgrams(t, q) for t in left]
    rsets = lsets if right is None else [qgrams(t, q) for t in right]
    index = _index(rsets)
    scores: dict[tuple[int, int], float] = {}
    for i, grams in enumerate(lsets):
        shared: dict[int, int] = defaultdict(int)
        for g in grams:
            posting = index.get(g, ())
            if len(posting) > max_posting:
                continue
            for j in posting:
                if right is not None or j > i:
                    shared[j] += 1
        for j, n in shared.items():
            score = n / (len(grams) + len(rsets[j]) - n)
            if score >= threshold:
                scores[(i, j)] = score
    return _top_k(scores, top_k, within=right is None)


def _top_k(scores: dict[tuple[int, int], float], k: int, *, within: bool) -> dict[tuple[int, int], float]:
    """Keep a pair when it is among the k best of its left record or of its right record."""
    by_record: dict[tuple[str, int], list[tuple[float, tuple[int, int]]]] = defaultdict(list)
    for pair, s in scores.items():
        by_record[("l", pair[0])].append((s, pair))
        by_record[("l" if within else "r", pair[1])].append((s, pair))
    keep: set[tuple[int, int]] = set()
    for items in by_record.values():
        items.sort(key=lambda x: (-x[0], x[1]))
        keep.update(pair for _, pair in items[:k])
    return {p: scores[p] for p in keep}


def candidate_pairs(texts: Sequence[str], keys: Sequence[Sequence[Hashable | None]] = (),
                    blocking: Blocking = Blocking()) -> dict[tuple[int, int], float]:
    """Candidate pairs (i < j) within one table: the union of exact-key pairs (one key column per entry of
    `keys`; score 1.0) and similar pairs (their Jaccard score)."""
    out: dict[tuple[int, int], float] = {}
    if blocking.threshold is not None:
        out.update(similar_pairs(texts, q=blocking.q, threshold=blocking.threshold, top_k=blocking.top_k,
                                 max_posting=blocking.max_posting))
    for column in keys:
        out.update({p: 1.0 for p in key_pairs(column)})
    return out


def cross_candidate_pairs(left: Sequence[str], right: Sequence[str],
                          keys: Sequence[tuple[Sequence[Hashable | None], Sequence[Hashable | None]]] = (),
                          blocking: Blocking = Blocking()) -> dict[tuple[int, int], float]:
    """Candidate pairs (i in left, j in right): similar pairs and pairs equal on any (left key, right key)."""
    out: dict[tuple[int, int], float] = {}
    if blocking.threshold is not None:
        out.update(similar_pairs(left, right, q=blocking.q, threshold=blocking.threshold, top_k=blocking.top_k,
                                 max_posting=blocking.max_posting))
    for lkeys, rkeys in keys:
        joined = list(lkeys) + list(rkeys)
        n = len(lkeys)
        out.update({(a, b - n): 1.0 for a, b in key_pairs(joined) if a < n <= b})
    return out


def pair_recall(found: Iterable[tuple[int, int]], true_pairs: Iterable[tuple[int, int]]) -> float:
    """Share of `true_pairs` (unordered) that `found` holds; 1.0 when there are none."""
    have = {tuple(sorted(p)) for p in found}
    want = {tuple(sorted(p)) for p in true_pairs}
    return len(want & have) / len(want) if want else 1.0
