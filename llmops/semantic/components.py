"""Connected components of matched pairs (union-find) and pairwise cluster quality (pure functions).

`components(n, pairs)` labels each of n records with the smallest record index of its component, so a
record that matched nothing is its own entity and the labels are stable for a given input. `true_pairs`
and `pair_scores` compare a clustering with labels the way entity-resolution papers do (over record pairs).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence


def components(n: int, pairs: Iterable[tuple[int, int]]) -> list[int]:
    """Component label of each record 0..n-1: the smallest index in its component (union-find with path
    halving; union by smaller root keeps that invariant)."""
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        if not (0 <= a < n and 0 <= b < n):
            raise IndexError(f"pair ({a}, {b}) names a record outside 0..{n - 1}")
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return [find(i) for i in range(n)]


def true_pairs(labels: Sequence[Hashable | None]) -> set[tuple[int, int]]:
    """Pairs (i < j) of records with the same non-null label (all pairs inside each cluster)."""
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, label in enumerate(labels):
        if label is not None:
            groups[label].append(i)
    return {(a, b) for rows in groups.values() for x, a in enumerate(rows) for b in rows[x + 1:]}


def pair_scores(predicted: Sequence[Hashable], truth: Sequence[Hashable]) -> dict[str, float]:
    """Pairwise precision, recall and F1 of clustering `predicted` against `truth` (same length)."""
    if len(predicted) != len(truth):
        raise ValueError(f"{len(predicted)} predicted labels for {len(truth)} true ones")
    got, want = true_pairs(predicted), true_pairs(truth)
    hit = len(got & want)
    precision = hit / len(got) if got else 1.0
    recall = hit / len(want) if want else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "predicted_pairs": len(got), "true_pairs": len(want)}
