"""Timers for benchmark harnesses: a wall-clock span and the median of repeated runs of a kernel."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable


class Timer:
    """`with Timer() as t: ...` then `t.seconds`; `t.mark()` records the first time something happened
    (`t.first`, seconds since the start), later calls are ignored. `t.elapsed` reads the clock while running."""

    def __init__(self) -> None:
        self.start = 0.0
        self.end: float | None = None
        self.first: float | None = None

    def __enter__(self) -> "Timer":
        self.start = time.perf_counter()
        self.end = None
        self.first = None
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end = time.perf_counter()

    @classmethod
    def started(cls) -> "Timer":
        """A timer already running, for a span that is no one block of code: read `.elapsed` at its end."""
        return cls().__enter__()

    @property
    def elapsed(self) -> float:
        return (self.end if self.end is not None else time.perf_counter()) - self.start

    @property
    def seconds(self) -> float:
        return self.elapsed

    def mark(self) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.start


def median_ms(fn: Callable[[], Any], device: Any, repeat: int, warmup: int = 2) -> float:
    """Median milliseconds of fn() over `repeat` runs after `warmup` runs (which compile Triton kernels):
    CUDA events on the current stream for a CUDA `device` (each run synced at its end), perf_counter
    elsewhere."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            with Timer() as t:
                fn()
            times.append(t.seconds * 1e3)
    return statistics.median(times)


def rows_per_hour(rows: int, seconds: float | None) -> float | None:
    """Rows per hour over `seconds` (None when no time was measured)."""
    return round(rows * 3600.0 / seconds, 1) if seconds else None
