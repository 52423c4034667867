"""Concurrent calls of one job merged into one engine run: Polars' streaming engine hands an expression
its morsels on several threads at once, and each morsel alone would make small blocks.

`Coalescer(fn)` is called like `fn` (an Arrow table in, a table of as many rows out, row for row) from any
number of threads. One caller at a time leads: it takes the waiting tables (at least its own turn's first,
up to `max_rows()` rows), runs `fn` once on their concatenation and hands each caller its slice. Callers
arriving while a run is in progress wait and are merged into the next run. The very first run waits
`gather_s` for the other threads' first morsels (they arrive together when a streaming query starts) and
hands all of them to `prepare` (the job plans for that width rather than one morsel's) before it takes
its first `max_rows()`, so results still come back run by run. An exception in a run is raised in every
caller whose table was in it.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pyarrow as pa

GATHER_S = 0.05      # how long the first run waits for morsels arriving with it (once per coalescer)
COALESCE_BLOCKS = 2  # a merged run of a job's concurrent tables holds at most this many of its plan's blocks


class _Request:
    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.result: pa.Table | None = None
        self.error: BaseException | None = None
        self.done = False


class Coalescer:
    """See module docstring. `max_rows()` bounds the rows of one merged run (None: no bound); a single
    table larger than it still runs whole."""

    def __init__(self, fn: Callable[[pa.Table], pa.Table], max_rows: Callable[[], int | None] = lambda: None,
                 gather_s: float = GATHER_S, prepare: Callable[[pa.Table], None] | None = None) -> None:
        self._fn, self._max_rows, self._gather_s, self._prepare = fn, max_rows, gather_s, prepare
        self._cv = threading.Condition()
        self._pending: list[_Request] = []
        self._busy = False
        self.runs = 0

    def __call__(self, table: pa.Table) -> pa.Table:
        req = _Request(table)
        with self._cv:
            self._pending.append(req)
        while True:
            with self._cv:
                while self._busy and not req.done:
                    self._cv.wait()
                if req.done:
                    break
                self._busy = True
                first = self.runs == 0
                if first and self._gather_s > 0:
                    self._cv.wait(self._gather_s)       # the other threads' first morsels join the first run
                waiting = [r.table for r in self._pending] if first and self._prepare is not None else []
            try:
                if waiting:
                    try:
                        self._prepare(_concat(waiting))
                    except BaseException:
                        with self._cv:
                            self._pending.remove(req)     # this caller raises; nobody else runs its table
                        raise
                with self._cv:
                    batch = self._take()
                self._run(batch)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

    def _take(self) -> list[_Request]:
        limit, rows, batch = self._max_rows(), 0, []
        while self._pending and (not batch or limit is None or rows + self._pending[0].table.num_rows <= limit):
            req = self._pending.pop(0)
            batch.append(req)
            rows += req.table.num_rows
        return batch

    def _run(self, batch: list[_Request]) -> None:
        try:
            tables = [r.table for r in batch]
            out = self._fn(_concat(tables))
            self.runs += 1
            if out.num_rows != sum(t.num_rows for t in tables):
                raise RuntimeError(f"coalesced run returned {out.num_rows} rows for {sum(t.num_rows for t in tables)}")
            offset = 0
            for r in batch:
                r.result = out.slice(offset, r.table.num_rows)
                offset += r.table.num_rows
        except BaseException as exc:  # every caller of the run sees the failure
            for r in batch:
                r.error = exc
        finally:
            for r in batch:
                r.done = True


def for_job(job: Any, fn: Callable[[pa.Table], pa.Table]) -> Coalescer:
    """The coalescer of one `llmops.core.Job`: its first run plans the job (`job.prepare`), and a merged
    run holds at most `COALESCE_BLOCKS` of the plan's blocks, so results come back every few blocks rather
    than once all concurrent tables are done (a single larger table still runs whole)."""
    def max_rows() -> int | None:
        policy = getattr(job.plan, "policy", None)
        return None if policy is None else COALESCE_BLOCKS * policy.block_size

    return Coalescer(fn, max_rows, prepare=job.prepare)


def _concat(tables: list[pa.Table]) -> pa.Table:
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="permissive")
