"""`RunSummary`: the figures of one map run (or of a job, summed over its calls), and the process-wide
record of the latest query's jobs behind `llmops.last_summary()` and `llmops.last_summaries()`. Pure
Python, no engine."""
from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from itertools import zip_longest
from typing import Any


@dataclass
class RunSummary:
    """Figures of one map run. rows: input rows; generated_rows: distinct prompts the engine ran;
    generated_tokens / prompt_tokens: tokens the engine produced / read in this run; seconds: wall time;
    cache_hits: rows served from the result cache; deduped: rows served by another row's identical
    prompt; nulls: null-input rows; errors: rows with finish_reason "error"; truncated: structured rows
    cut by max_new_tokens (null output, finish_reason "length"). Per model (`llmops.cascade`): rows_by_model,
    the rows each model answered (generated or cached); seconds_by_model, the wall seconds of each model's
    part of the run; escalated, rows run again on a later model (once per move). confidence_bins: a histogram
    of the answered rows' confidence (`llmops.cascade.confidence_bins`: 10 bins over [0, 1])."""

    rows: int = 0
    generated_rows: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    cache_hits: int = 0
    deduped: int = 0
    nulls: int = 0
    errors: int = 0
    truncated: int = 0
    done_rows: int = 0
    calls: int = 1
    escalated: int = 0
    rows_by_model: dict[str, int] = field(default_factory=dict)
    seconds_by_model: dict[str, float] = field(default_factory=dict)
    confidence_bins: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per wall-clock second of the run so far."""
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}

    def add(self, other: RunSummary) -> None:
        """Add `other`'s figures to these (a job's summary over its calls): numbers add, per-model figures
        add per model, histogram bins add bin by bin."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, dict):
                setattr(self, f.name, {k: mine.get(k, 0) + theirs.get(k, 0) for k in {**mine, **theirs}})
            elif isinstance(mine, list):
                setattr(self, f.name, [a + b for a, b in zip_longest(mine, theirs, fillvalue=0)])
            else:
                setattr(self, f.name, mine + theirs)

    def __str__(self) -> str:
        return (f"{self.rows} rows in {self.seconds:.1f}s: {self.generated_tokens} tokens generated "
                f"({self.tokens_per_s:.1f} tok/s), {self.cache_hits} cache hits, {self.deduped} deduped, "
                f"{self.nulls} nulls, {self.errors} errors, {self.truncated} cut by max_new_tokens"
                + self._by_model())

    def _by_model(self) -> str:
        """`; N escalated; by model: a 90 rows in 1.2s, b 10 rows in 3.4s` when more than one model answered."""
        if len(self.rows_by_model) < 2:
            return ""
        models = ", ".join(f"{m} {n} rows in {self.seconds_by_model.get(m, 0.0):.1f}s"
                           for m, n in self.rows_by_model.items())
        return f"; {self.escalated} escalated; by model: {models}"


FAILURES_LISTED = 10   # failed rows each listed with its reason; beyond that, counts by reason and a few rows
FAILURES_SHOWN = 3


def describe_failures(failed: int, by_reason: Mapping[str, int], examples: Sequence[tuple[str, str]]) -> list[str]:
    """Lines saying why rows failed: with at most `FAILURES_LISTED` failed rows, each row and its reason
    (`examples`: (which row, why), the first failed rows); with more, the count per reason and the first
    `FAILURES_SHOWN` rows. [] when nothing failed."""
    if failed <= 0:
        return []
    if failed <= FAILURES_LISTED and len(examples) >= failed:
        return [f"  {where}: {why}" for where, why in examples[:failed]]
    lines = [f"  {n} {reason}" for reason, n in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0]))]
    lines += [f"  e.g. {where}: {why}" for where, why in examples[:FAILURES_SHOWN]]
    return lines


class _Query:
    """The jobs of one query (see `last_summary`): their summaries in order of first record, and the span
    of their calls."""

    def __init__(self, began: float) -> None:
        self.jobs: list[tuple[Callable[[], object], RunSummary]] = []   # (weak reference to the job, summary)
        self.began = began
        self.ended = began
        self.read = False

    def holds(self, job: object) -> int | None:
        return next((k for k, (ref, _) in enumerate(self.jobs) if ref() is job), None)


_query: list[_Query] = []
_last_lock = threading.Lock()


def last_summary() -> RunSummary | None:
    """The figures of the most recent query in this process (None before the first run), any thread (DuckDB
    runs UDFs on its own threads). A query is the jobs that ran together: a job (one map run, one Polars
    expression, one registered DuckDB function) joins the latest query when it was built before that query's
    last call ended, or when it is already part of it; so the expressions of one Polars `with_columns` or
    `select` are one query, however Polars schedules them, and two runs one after the other are two. Reading
    the summary ends the query: the next job starts a new one. One job: its summary, all its calls so far (a
    DuckDB query's vectors, a Polars expression's morsels). Several: their figures added up (`rows` counts
    each job's rows, `calls` every call), `seconds` the wall time from the first call's start to the last
    call's end; `last_summaries()` gives them one per job."""
    with _last_lock:
        if not _query:
            return None
        query = _query[-1]
        query.read = True
        if len(query.jobs) == 1:
            return query.jobs[0][1]
        total = RunSummary(calls=0)
        for _, summary in query.jobs:
            total.add(summary)
        total.seconds = query.ended - query.began
        return total


def last_summaries() -> list[RunSummary]:
    """The summary of each job of the most recent query (see `last_summary`), in the order they first
    finished a call; [] before the first run."""
    with _last_lock:
        if not _query:
            return []
        _query[-1].read = True
        return [summary for _, summary in _query[-1].jobs]


def record(summary: RunSummary, *, job: object = None, created: float | None = None,
           began: float | None = None) -> None:
    """Make `summary` (job `job`'s, all its calls so far) part of what `last_summary()` returns (any thread).
    created: when the job was built (`time.perf_counter()`); began: when the call that just ended started.
    Without `job` the summary is a query of its own."""
    now = time.perf_counter()
    began = now - summary.seconds if began is None else began
    opened = created if created is not None and summary.calls <= 1 else began
    with _last_lock:
        query = _query[-1] if _query and not _query[-1].read else None
        at = None if query is None or job is None else query.holds(job)
        if query is None or (at is None and (job is None or opened > query.ended)):
            query, at = _Query(began), None
            _query[:] = [query]
        if at is None:
            query.jobs.append((weakref.ref(job) if job is not None else lambda: None, summary))
        else:
            query.jobs[at] = (query.jobs[at][0], summary)
        query.began = min(query.began, began)
        query.ended = max(query.ended, now)
