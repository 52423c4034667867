"""Result cache: round trip, atomic per-block writes, errors not stored, persistence, default dir."""
from __future__ import annotations

import pytest

from llmops.result_cache import CachedResult, ResultCache, default_cache_dir, result_key


def test_key_depends_on_every_part():
    base = result_key("fp", "prompt", {"t": 0})
    assert base == result_key("fp", "prompt", {"t": 0})
    assert len({base, result_key("fp2", "prompt", {"t": 0}), result_key("fp", "prompt2", {"t": 0}),
                result_key("fp", "prompt", {"t": 1}), result_key("fp", [{"role": "user", "content": "prompt"}],
                                                                {"t": 0})}) == 5


def test_round_trip_and_persistence(tmp_path):
    cache = ResultCache(tmp_path)
    ok = CachedResult("out", "stop", 5, 2)
    assert cache.put_many([("k1", ok), ("k2", CachedResult("", "error", 0, 0))]) == 1
    assert cache.get_many(["k1", "k2", "k3"]) == {"k1": ok}
    cache.close()
    again = ResultCache(tmp_path)
    assert again.get_many(["k1"]) == {"k1": ok} and len(again) == 1


def test_block_write_is_all_or_nothing(tmp_path):
    cache = ResultCache(tmp_path)

    def items():
        yield "a", CachedResult("x", "stop", 1, 1)
        raise RuntimeError("crash while building the block")

    with pytest.raises(RuntimeError):
        cache.put_many(items())
    assert len(cache) == 0
    cache.put_many([("a", CachedResult("x", "stop", 1, 1)), ("b", CachedResult("y", "length", 1, 1))])
    assert len(cache) == 2


def test_get_many_over_chunk_size(tmp_path):
    cache = ResultCache(tmp_path)
    cache.put_many((f"k{i}", CachedResult(str(i), "stop", 1, 1)) for i in range(1200))
    got = cache.get_many([f"k{i}" for i in range(0, 1300)])
    assert len(got) == 1200 and got["k1199"].text == "1199"


def test_default_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMOPS_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("LLMOPS_CACHE_DIR")
    assert default_cache_dir().parts[-3:] == (".cache", "llmops", "results")
