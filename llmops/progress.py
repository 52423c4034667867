"""Progress of a long map: rows, generated tokens/s, ETA, cache hits, errors (tqdm on stderr).

Quiet when disabled or when stderr is not a TTY (`enabled=None` decides by the TTY). The figures shown
are the `RunSummary` the caller keeps; this class only displays them. A bar moves per row as rows finish
(`advance`, called from the engine's `on_finished` report) and is set to the caller's count of emitted rows
when a block is yielded (`show`), never backwards. A job reached in many calls (DuckDB vectors, Polars
morsels) keeps one bar whose total grows by each call's rows (`grow`): its ETA is for the rows seen so far.
"""
from __future__ import annotations

import sys
import threading
from typing import Any

from tqdm.auto import tqdm


def _want(enabled: bool | None) -> bool:
    if enabled is not None:
        return enabled
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


class Progress:
    """A progress bar over `total` rows (no-op when quiet)."""

    def __init__(self, total: int, *, enabled: bool | None = None, desc: str = "llm_map") -> None:
        self._bar: Any = None
        self._lock = threading.Lock()
        self.done = 0
        if _want(enabled):
            self._bar = tqdm(total=total, desc=desc, unit="row", file=sys.stderr, dynamic_ncols=True,
                             mininterval=0.2)

    def grow(self, rows: int) -> None:
        """Add `rows` to the total (a later call of the same job)."""
        if self._bar is not None:
            with self._lock:
                self._bar.total = (self._bar.total or 0) + rows
                self._bar.refresh()

    def advance(self, rows: int, *, tokens_per_s: float | None = None) -> None:
        """`rows` more rows finished (reported as they finish, before their block is yielded)."""
        with self._lock:
            self.done += rows
            if self._bar is not None:
                if tokens_per_s is not None:
                    self._bar.set_postfix_str(f"tok/s={tokens_per_s:.1f}", refresh=False)
                self._bar.update(rows)

    def update(self, rows: int, *, tokens_per_s: float, cache_hits: int, errors: int) -> None:
        """Advance by `rows` finished rows and refresh the figures."""
        with self._lock:
            step = max(0, rows)
            self.done += step
            if self._bar is not None:
                self._bar.set_postfix({"tok/s": f"{tokens_per_s:.1f}", "cached": cache_hits, "errors": errors},
                                      refresh=False)
                self._bar.update(step)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
