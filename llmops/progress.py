"""Progress of a long map: rows, generated tokens/s, ETA, cache hits, errors (tqdm on stderr).

Quiet when disabled or when stderr is not a TTY (`enabled=None` decides by the TTY). The figures shown
are the `RunSummary` the caller keeps; this class only displays them.
"""
from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm


def _want(enabled: bool | None) -> bool:
    if enabled is not None:
        return enabled
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


class Progress:
    """A progress bar over `total` rows; `update` is called once per finished batch of rows."""

    def __init__(self, total: int, *, enabled: bool | None = None, desc: str = "llm_map") -> None:
        self._bar: Any = None
        if _want(enabled) and total > 0:
            self._bar = tqdm(total=total, desc=desc, unit="row", file=sys.stderr, dynamic_ncols=True)

    def update(self, rows: int, *, tokens_per_s: float, cache_hits: int, errors: int) -> None:
        """Advance by `rows` finished rows and refresh the figures (no-op when quiet)."""
        if self._bar is None:
            return
        self._bar.set_postfix({"tok/s": f"{tokens_per_s:.1f}", "cached": cache_hits, "errors": errors},
                              refresh=False)
        self._bar.update(rows)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
