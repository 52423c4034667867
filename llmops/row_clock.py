"""`RowClock`: rows finished per time bucket over a run (throughput over time), in bounded memory.

A run of 10^8 rows cannot keep one timestamp per row, so rows are counted into buckets of `bucket_s`
seconds since the run began; when the run outlasts `max_buckets` buckets, the width doubles and
neighbouring buckets merge, so a run of any length keeps at most `max_buckets` counts. Pure Python.
"""
from __future__ import annotations

from typing import Any

FIRST_BUCKET_S = 0.25
MAX_BUCKETS = 120


class RowClock:
    """Counts of rows finished per bucket: `rows[b]` finished in [b * bucket_s, (b + 1) * bucket_s)."""

    def __init__(self, bucket_s: float = FIRST_BUCKET_S, max_buckets: int = MAX_BUCKETS) -> None:
        if bucket_s <= 0 or max_buckets < 2:
            raise ValueError(f"RowClock: bucket_s must be > 0 and max_buckets >= 2, got {bucket_s}, {max_buckets}")
        self.bucket_s = float(bucket_s)
        self.max_buckets = max_buckets
        self.rows: list[int] = []

    def add(self, seconds: float, rows: int) -> None:
        """`rows` rows finished `seconds` after the run began."""
        if rows <= 0:
            return
        index = int(max(0.0, seconds) // self.bucket_s)
        while index >= self.max_buckets:
            self._widen()
            index = int(max(0.0, seconds) // self.bucket_s)
        if index >= len(self.rows):
            self.rows.extend([0] * (index + 1 - len(self.rows)))
        self.rows[index] += rows

    def _widen(self) -> None:
        """Double the bucket width, merging bucket pairs."""
        self.rows = [sum(self.rows[i:i + 2]) for i in range(0, len(self.rows), 2)]
        self.bucket_s *= 2

    @property
    def total(self) -> int:
        return sum(self.rows)

    def to_dict(self) -> dict[str, Any]:
        """{"bucket_s": width, "rows": [rows finished in each bucket]} (JSON-ready)."""
        return {"bucket_s": self.bucket_s, "rows": list(self.rows)}
