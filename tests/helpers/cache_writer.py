"""A result-cache writer run in other processes (spawned, or killed mid-write) by the durability tests."""
from __future__ import annotations

from llmops.result_cache import CachedResult, ResultCache


def write_rows(cache_dir: str, tag: str, n: int) -> None:
    """`n` transactions of 5 rows each (keys `{tag}-{i}-{j}`) into the result cache at `cache_dir`."""
    cache = ResultCache(cache_dir)
    for i in range(n):
        cache.put_many([(f"{tag}-{i}-{j}", CachedResult(f"{tag}{i}", "stop", 1, 1)) for j in range(5)])
    cache.close()
