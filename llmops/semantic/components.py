"""Clusters of matched pairs and pairwise cluster quality (pure functions).

`components(n, pairs)` labels each of n records with the smallest record index of its connected component,
so a record that matched nothing is its own entity and the labels are stable for a given input.
`clusters(n, same, different)` is what `resolve` uses: the components of the `same` pairs cut by the
`different` ones (a light correlation clustering). A chain of Same answers (a ~ b, b ~ c) never puts two
records the model called Different (a, c) into one entity: the `same` pairs are merged in the order given
(best first), and a merge is skipped when any pair across the two clusters is a `different` pair. `true_pairs`
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
        _check(n, a, b)
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return [find(i) for i in range(n)]


def clusters(n: int, same: Iterable[tuple[int, int]], different: Iterable[tuple[int, int]] = ()) -> list[int]:
    """Cluster label of each record 0..n-1 (its cluster's smallest index): the `same` pairs merged in order,
    each merge skipped when a `different` pair would end up inside one cluster (see module docstring).
    Without `different` pairs this is `components(n, same)`."""
    members = [{i} for i in range(n)]
    apart: list[set[int]] = [set() for _ in range(n)]     # per cluster root: records it must not join
    root = list(range(n))
    for a, b in different:
        _check(n, a, b)
        apart[a].add(b)
        apart[b].add(a)
    for a, b in same:
        _check(n, a, b)
        ra, rb = root[a], root[b]
        if ra == rb or apart[ra] & members[rb]:
            continue
        keep, gone = min(ra, rb), max(ra, rb)        # a root is its cluster's smallest index
        for i in members[gone]:
            root[i] = keep
        members[keep] |= members[gone]
        apart[keep] |= apart[gone]
        members[gone], apart[gone] = set(), set()
    return root


def _check(n: int, a: int, b: int) -> None:
    if not (0 <= a < n and 0 <= b < n):
        raise IndexError(f"pair ({a}, {b}) names a record outside 0..{n - 1}")


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
