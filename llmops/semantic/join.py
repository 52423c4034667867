"""`llm_join`: match the rows of two tables: blocking -> LLM comparison of candidate pairs -> matched pairs.

Candidate pairs (i in left, j in right) come from q-gram similarity of the compared columns' values
(`left_on`, `right_on`; `blocking_text`; or their embedding neighbours with an `EmbeddingBlocking`,
`llmops.semantic.embed_blocking`) and equal exact keys (`blocking.keys`, named in both tables); the
model sees each candidate pair once in each order (A/B and B/A, both in the one `map_table` job), and
`confidence` is the share of the two answers that say Same (0, 0.5 or 1): order-swap agreement, which cancels
a small model's position bias.
Pairs with `confidence >= min_confidence` are returned: the left row's columns, the right row's columns
(suffixed `suffix` where a name is taken), `similarity` (the blocking score) and `confidence`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa

from llmops.semantic.blocking import Blocking, blocking_text
from llmops.semantic.compare import compare_pairs, pair_table
from llmops.semantic.embed_blocking import AnyBlocking, cross_pairs_for
from llmops.semantic.options import Llm
from llmops.semantic.resolve import check_columns


@dataclass
class JoinReport:
    """Figures of one llm_join run: all left x right pairs, candidates, prompts (two per pair), matches."""

    left_rows: int
    right_rows: int
    all_pairs: int
    candidate_pairs: int
    prompts: int
    matched_pairs: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _joined(left: pa.Table, right: pa.Table, suffix: str) -> tuple[list[str], list[str]]:
    names = list(left.column_names)
    right_names = [f"{c}{suffix}" if c in names else c for c in right.column_names]
    return names, right_names


def llm_join_table(left: pa.Table, right: pa.Table, llm: Llm, *, left_on: str | Sequence[str],
                   right_on: str | Sequence[str] | None = None, blocking: AnyBlocking = Blocking(),
                   template: str | None = None, min_confidence: float = 0.5,
                   suffix: str = "_right") -> tuple[pa.Table, JoinReport]:
    """Matched pairs of `left` and `right` (see module docstring) and the run's report."""
    left_on = [left_on] if isinstance(left_on, str) else list(left_on)
    right_on = left_on if right_on is None else [right_on] if isinstance(right_on, str) else list(right_on)
    if not left_on or len(left_on) != len(right_on):
        raise ValueError(f"llm_join: left_on {left_on} and right_on {right_on} must name as many columns, at least one")
    if not 0 < min_confidence <= 1:
        raise ValueError(f"llm_join: min_confidence must be in (0, 1], got {min_confidence}")
    check_columns(left, [*left_on, *blocking.keys], "llm_join (left)")
    check_columns(right, [*right_on, *blocking.keys], "llm_join (right)")
    # only the compared and blocking columns become Python rows (the output takes whole rows from the tables)
    lrows = left.select(list(dict.fromkeys([*left_on, *blocking.keys]))).to_pylist()
    rrows = right.select(list(dict.fromkeys([*right_on, *blocking.keys]))).to_pylist()
    ltexts, rtexts = [blocking_text(r, left_on) for r in lrows], [blocking_text(r, right_on) for r in rrows]
    keys = [([r[k] for r in lrows], [r[k] for r in rrows]) for k in blocking.keys]
    candidates = cross_pairs_for(blocking, ltexts, rtexts, keys, llm)
    pairs = sorted(p for p in candidates if ltexts[p[0]] and rtexts[p[1]])
    # The compared columns go by the left names on both sides, so one template serves both orders.
    renamed = [{a: r.get(b) for a, b in zip(left_on, right_on)} for r in rrows]
    forward = pair_table(lrows, renamed, pairs, left_on, left_on)
    backward = pair_table(renamed, lrows, [(j, i) for i, j in pairs], left_on, left_on)
    same = compare_pairs(pa.concat_tables([forward, backward]), llm, template=template) if pairs else []
    n = len(pairs)
    confidence = [(bool(same[k]) + bool(same[n + k])) / 2 for k in range(n)]
    keep = [k for k in range(n) if confidence[k] >= min_confidence]
    names, right_names = _joined(left, right, suffix)
    out = left.take(pa.array([pairs[k][0] for k in keep], pa.int64()))
    taken = right.take(pa.array([pairs[k][1] for k in keep], pa.int64()))
    for name, col in zip(right_names, taken.columns):
        out = out.append_column(name, col)
    out = out.append_column("similarity", pa.array([candidates[pairs[k]] for k in keep], pa.float64()))
    out = out.append_column("confidence", pa.array([confidence[k] for k in keep], pa.float64()))
    report = JoinReport(left.num_rows, right.num_rows, left.num_rows * right.num_rows, len(candidates), 2 * n,
                        len(keep))
    return out, report
