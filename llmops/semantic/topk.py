"""`llm_topk`: the k rows that best answer a question, ranked by pairwise LLM comparisons (LOTUS's sem_topk).

The question is a template whose placeholders name the compared columns ("Which {subject} is the most
urgent?"); the model sees it with the placeholders as column names ("Which subject is the most urgent?") and
two rows, each rendered as `column: value; ...` (one column: its bare value) and given as data, and answers
`A` or `B` (`choices=("A", "B")`). Rows whose compared columns are all null are not ranked.

Ranking is a partial quicksort run level by level, so it compares far fewer than the n(n-1)/2 pairs a full
tournament would: each round picks a random pivot in every part of the ranking that still overlaps the top
k, compares every other row of the part with its pivot, and splits the part into (better, pivot, worse);
parts that start at or after position k are dropped. Every comparison of a round is one row of one
`map_table` call (one engine call per round, dedup and the result cache apply). Expected cost: about 2n
comparisons to find the top k, plus about 2k ln k to order them, in O(log n) rounds. The side each row takes
(A or B) is drawn at random (`seed`), so a model's preference for one position does not favour pivots. A
comparison with no answer (an error) counts the row as not better than its pivot, and is reported.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa

from llmops.semantic.compare import render_record
from llmops.semantic.options import Llm
from llmops.semantic.resolve import check_columns
from llmops.templates import render, template_fields

A, B = "A", "B"
SYSTEM = "Compare two items by the question. Answer A or B: the item that answers the question better."
PAIR = "\n\nA: {a}\n\nB: {b}\n\nWhich answers the question better, A or B?"


@dataclass
class TopKReport:
    """Figures of one llm_topk run: rows, ranked rows, k, comparisons and rounds (engine calls), all pairs a
    full tournament would compare, comparisons without an answer."""

    rows: int
    ranked: int
    k: int
    comparisons: int = 0
    rounds: int = 0
    all_pairs: int = 0
    failed_comparisons: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def question_text(template: str) -> str:
    """The question the model sees: `template` with each placeholder replaced by its column name."""
    return render(template, {f: f for f in template_fields(template)})


def pair_template(template: str) -> str:
    """The comparison template: the question (braces escaped) then the two rows `{a}` and `{b}`."""
    question = question_text(template).replace("{", "{{").replace("}", "}}")
    return question + PAIR


def ranking(n: int, k: int, better: Any, rng: random.Random) -> tuple[list[int], int]:
    """The top `k` of items 0..n-1, best first, by partial quicksort (see module docstring), and the number of
    rounds. `better(pairs)` answers a round: per (item, pivot) pair, True when the item is better, False when
    not, None for no answer (taken as not better). Pure but for `better`."""
    parts: list[list[int]] = [list(range(n))] if n else []
    rounds = 0
    while True:
        start, active, work = 0, [], []
        for p, part in enumerate(parts):
            if start >= k:
                parts = parts[:p]
                break
            if len(part) > 1:
                pivot = rng.choice(part)
                active.append((p, pivot))
                work += [(item, pivot) for item in part if item != pivot]
            start += len(part)
        if not active:
            break
        rounds += 1
        answers = dict(zip(work, better(work)))
        for p, pivot in reversed(active):
            part = parts[p]
            up = [i for i in part if i != pivot and answers[(i, pivot)]]
            down = [i for i in part if i != pivot and not answers[(i, pivot)]]
            parts[p:p + 1] = [x for x in (up, [pivot], down) if x]
    return [i for part in parts for i in part][:k], rounds


def llm_topk_table(table: pa.Table, template: str, k: int, llm: Llm, *, rank: str = "rank",
                   seed: int = 0) -> tuple[pa.Table, TopKReport]:
    """The `k` rows of `table` that best answer `template`'s question, best first, with their place (1 = best)
    in column `rank` (see module docstring); fewer when fewer rows can be ranked."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"llm_topk: k must be a positive integer, got {k!r}")
    fields = list(template_fields(template))
    if not fields:
        raise ValueError(f"llm_topk: template {template!r} names no column to compare")
    check_columns(table, fields, "llm_topk template")
    rows = table.select(fields).to_pylist()
    texts = [render_record(r, fields) for r in rows]
    items = [i for i, t in enumerate(texts) if t]
    report = TopKReport(rows=table.num_rows, ranked=len(items), k=k, all_pairs=len(items) * (len(items) - 1) // 2)
    rng = random.Random(seed)
    spec = llm.spec(pair_template(template), choices=(A, B), system=llm.generation.get("system", SYSTEM),
                    max_new_tokens=llm.generation.get("max_new_tokens", 2))

    def better(pairs: list[tuple[int, int]]) -> list[bool | None]:
        """One engine call: is each item better than its pivot? (sides drawn at random)"""
        swap = [rng.random() < 0.5 for _ in pairs]
        first = [texts[items[p] if s else items[i]] for (i, p), s in zip(pairs, swap)]
        second = [texts[items[i] if s else items[p]] for (i, p), s in zip(pairs, swap)]
        answers = llm.run(pa.table({"a": pa.array(first, pa.string()), "b": pa.array(second, pa.string())}), spec,
                          output_name="answer").table.column("output").to_pylist()
        report.comparisons += len(pairs)
        report.failed_comparisons += sum(a is None for a in answers)
        return [None if a is None else (a == B) == s for a, s in zip(answers, swap)]

    top, report.rounds = ranking(len(items), k, better, rng)
    chosen = [items[i] for i in top]
    out = table.take(pa.array(chosen, pa.int64()))
    if rank in out.column_names:
        out = out.drop_columns([rank])
    return out.append_column(rank, pa.array(range(1, len(chosen) + 1), pa.int64())), report
