"""`RunSummary`: the figures of one map run (or of a job, summed over its calls), and the process-wide
record of the latest job's summary behind `llmops.last_summary()`. Pure Python, no engine."""
from __future__ import annotations

import threading
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


_last: list[RunSummary] = []
_last_lock = threading.Lock()


def last_summary() -> RunSummary | None:
    """The summary of the job of the most recent finished (or failed) map run in this process, any thread
    (DuckDB runs UDFs on its own threads): all the calls of that job so far (a DuckDB query's vectors, a
    Polars expression's morsels). None before the first run."""
    with _last_lock:
        return _last[-1] if _last else None


def record(summary: RunSummary) -> None:
    """Make `summary` what `last_summary()` returns (any thread)."""
    with _last_lock:
        _last[:] = [summary]
