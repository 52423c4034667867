"""Progress of a long map: rows done, decode steps, generated tokens, tokens/s, ETA (tqdm on stderr).

Quiet when disabled or when stderr is not a TTY (`enabled=None` decides by the TTY). The caller reports:
- `expect(rows, max_new_tokens, predicted_tokens_per_s)`: rows it is about to generate (not cached), the most
  tokens each may take, and the plan's predicted speed (None when the engine has no plan); `idle()` when that
  generation is over;
- `step(tokens)`: tokens chosen in one decode step (the engine's `on_step`), so the display moves while a
  block decodes, before any of its rows finish;
- `advance(rows, tokens=...)`: rows finished in the decode loop (the engine's `on_finished`) and their tokens;
- `update(rows, ...)`: rows emitted when a block is yielded or served from the cache (the bar is set to the
  caller's count of emitted rows, never backwards).

The ETA is for generation only, so rows served from the cache do not make it look done: remaining tokens
(rows expected x tokens per finished row so far, `max_new_tokens` before any row finished, less the tokens
already generated) over the measured rate (tokens per second since generation began), or over the plan's
predicted rate before the first step. The clock is redrawn every `TICK_S` while rows are being generated, so it
runs through a long prefill; an idle bar (a Polars expression's between queries) is left alone. A job reached in many calls (DuckDB vectors, Polars morsels) keeps one bar whose total
grows by each call's rows (`grow`): its ETA is for the rows seen so far.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any

from tqdm.auto import tqdm

TICK_S = 1.0          # the clock and ETA are redrawn at least this often while the bar is open
MIN_DRAW_S = 0.2      # decode steps redraw the bar at most this often
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} rows [{elapsed}{postfix}]"


def _want(enabled: bool | None) -> bool:
    if enabled is not None:
        return enabled
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def format_eta(seconds: float | None) -> str:
    """`ETA 1:05` (minutes:seconds, hours when long) or `ETA ?` when unknown."""
    if seconds is None:
        return "ETA ?"
    s = int(round(seconds))
    return f"ETA {s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"ETA {s // 60}:{s % 60:02d}"


class Progress:
    """A progress bar over `total` rows (no-op when quiet; the figures are kept either way)."""

    def __init__(self, total: int, *, enabled: bool | None = None, desc: str = "llm_map") -> None:
        self._bar: Any = None
        self._lock = threading.Lock()
        self.done = 0                  # rows shown as done
        self.expected = 0              # rows to generate (`expect`)
        self.max_new_tokens = 0
        self.predicted_tokens_per_s: float | None = None
        self.steps = 0                 # decode steps seen (`step`)
        self.tokens = 0                # tokens generated so far
        self.finished_rows = 0         # generated rows finished, and their tokens
        self.finished_tokens = 0
        self.cache_hits = 0
        self.errors = 0
        self.began: float | None = None    # when generation began (the first `expect`)
        self._drawn = 0.0                  # when a step last redrew the bar
        self._generating = 0               # calls between `expect` and `idle` (the ticker redraws meanwhile)
        self._stop = threading.Event()
        if _want(enabled):
            self._bar = tqdm(total=total, desc=desc, unit="row", file=sys.stderr, dynamic_ncols=True,
                             mininterval=MIN_DRAW_S, bar_format=BAR_FORMAT)
            threading.Thread(target=self._tick, name="llmops-progress", daemon=True).start()

    def grow(self, rows: int) -> None:
        """Add `rows` to the total (a later call of the same job)."""
        if self._bar is not None:
            with self._lock:
                self._bar.total = (self._bar.total or 0) + rows
                self._bar.refresh()

    def expect(self, rows: int, max_new_tokens: int, predicted_tokens_per_s: float | None = None) -> None:
        """`rows` rows are about to be generated, each at most `max_new_tokens` tokens long."""
        with self._lock:
            self.expected += rows
            self.max_new_tokens = max(self.max_new_tokens, max_new_tokens)
            if predicted_tokens_per_s:
                self.predicted_tokens_per_s = predicted_tokens_per_s
            if self.began is None:
                self.began = time.perf_counter()
            self._generating += 1
            self._show(refresh=True)

    def idle(self) -> None:
        """The generation announced by the matching `expect` is over (finished or failed)."""
        with self._lock:
            self._generating = max(0, self._generating - 1)

    def step(self, tokens: int) -> None:
        """One decode step chose `tokens` tokens (called from the engine's decode loop: quick; the bar is
        redrawn at most every `MIN_DRAW_S`)."""
        with self._lock:
            self.steps += 1
            self.tokens += tokens
            now = time.perf_counter()
            draw = now - self._drawn >= MIN_DRAW_S
            self._drawn = now if draw else self._drawn
            self._show(refresh=draw)

    def advance(self, rows: int, *, tokens: int = 0, tokens_per_s: float | None = None) -> None:
        """`rows` more rows finished (reported as they finish, before their block is yielded), their
        generated tokens `tokens`. `tokens_per_s`: the caller's rate, for an engine without `step` reports."""
        with self._lock:
            self.done += rows
            self.finished_rows += 1 if rows else 0
            self.finished_tokens += tokens
            if self.steps == 0:
                self.tokens += tokens
            if self._bar is not None:
                self._show(refresh=False)
                self._bar.update(rows)

    def update(self, rows: int, *, tokens_per_s: float, cache_hits: int, errors: int) -> None:
        """Advance by `rows` emitted rows (a yielded block, cache hits) and refresh the figures."""
        with self._lock:
            step = max(0, rows)
            self.done += step
            self.cache_hits, self.errors = cache_hits, errors
            if self._bar is not None:
                self._show(refresh=False)
                self._bar.update(step)

    def eta(self, now: float | None = None) -> float | None:
        """Seconds of generation left (see module docstring); 0 when nothing is left to generate, None when
        there is no rate yet (no step measured and no prediction)."""
        per_row = self.finished_tokens / self.finished_rows if self.finished_rows else self.max_new_tokens
        left = max(0.0, self.expected * per_row - self.tokens)
        if left == 0:
            return 0.0
        elapsed = (now if now is not None else time.perf_counter()) - (self.began or 0.0)
        rate = self.tokens / elapsed if self.tokens and elapsed > 0 else self.predicted_tokens_per_s
        return left / rate if rate else None

    def postfix(self) -> str:
        """The figures after the bar: `step 12, 96 tok, 8.0 tok/s, 3 cached, ETA 0:41`."""
        elapsed = time.perf_counter() - self.began if self.began is not None else 0.0
        parts = [f"step {self.steps}"] if self.steps else []
        parts.append(f"{self.tokens} tok")
        if elapsed > 0 and self.tokens:
            parts.append(f"{self.tokens / elapsed:.1f} tok/s")
        if self.cache_hits:
            parts.append(f"{self.cache_hits} cached")
        if self.errors:
            parts.append(f"{self.errors} errors")
        if self.expected:
            parts.append(format_eta(self.eta()))
        return ", ".join(parts)

    def _show(self, *, refresh: bool) -> None:
        """Put the figures on the bar (the caller holds the lock)."""
        if self._bar is not None:
            self._bar.set_postfix_str(self.postfix(), refresh=refresh)

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            with self._lock:
                if self._bar is None:
                    return
                if self._generating:
                    self._show(refresh=True)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
