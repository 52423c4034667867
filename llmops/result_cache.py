"""Result cache: finished generations persisted in one SQLite file so reruns compute only what is missing.

A row's key is sha256 over (model fingerprint, rendered prompt, sampling params), see `result_key`. Each
`put_many` call is one transaction: a block's results are either all on disk or none are, so a crash or
`kill -9` mid-run loses at most the block in flight and never leaves a partial row. SQLite's WAL journal
makes concurrent readers/writers (threads or processes) safe; every method is thread-safe.
Completions whose finish_reason is "error" are not stored (a rerun retries them).
"""
from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SCHEMA = """CREATE TABLE IF NOT EXISTS results (
    key TEXT PRIMARY KEY, text TEXT NOT NULL, finish_reason TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL)"""
_CHUNK = 500


@dataclass(frozen=True)
class CachedResult:
    """One stored completion (what the operator needs to rebuild an output row)."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def default_cache_dir() -> Path:
    """`$LLMOPS_CACHE_DIR` when set, else `~/.cache/llmops/results`."""
    env = os.environ.get("LLMOPS_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llmops" / "results"


def result_key(fingerprint: str, prompt: Any, params: dict[str, Any]) -> str:
    """Stable hex key of one generation request (prompt: a string, messages or token ids)."""
    payload = json.dumps([fingerprint, prompt, params], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


class ResultCache:
    """Owner of one SQLite file `<cache_dir>/results.sqlite`."""

    def __init__(self, cache_dir: str | Path | None = None) -> None:
        self.dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "results.sqlite"
        self._lock = threading.Lock()
        try:
            self._con = sqlite3.connect(self.path, timeout=60, check_same_thread=False, isolation_level=None)
            self._con.execute("PRAGMA journal_mode=WAL")
            self._con.execute("PRAGMA synchronous=NORMAL")
            self._con.execute(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise RuntimeError(f"result cache {self.path} is unreadable ({exc}); delete it or pass another "
                               "cache_dir") from exc

    def get_many(self, keys: Sequence[str]) -> dict[str, CachedResult]:
        """The stored results among `keys` (missing keys are absent from the dict)."""
        out: dict[str, CachedResult] = {}
        with self._lock:
            for start in range(0, len(keys), _CHUNK):
                chunk = list(keys[start:start + _CHUNK])
                marks = ",".join("?" * len(chunk))
                rows = self._con.execute(
                    f"SELECT key, text, finish_reason, prompt_tokens, completion_tokens FROM results "
                    f"WHERE key IN ({marks})", chunk).fetchall()
                for key, text, reason, pt, ct in rows:
                    out[key] = CachedResult(text, reason, pt, ct)
        return out

    def put_many(self, items: Iterable[tuple[str, CachedResult]]) -> int:
        """Store all `items` in one transaction (all or nothing); error results are skipped. Returns the
        number stored."""
        rows = [(k, r.text, r.finish_reason, r.prompt_tokens, r.completion_tokens)
                for k, r in items if r.finish_reason != "error"]
        if not rows:
            return 0
        with self._lock:
            self._con.execute("BEGIN IMMEDIATE")
            try:
                self._con.executemany("INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?, ?)", rows)
            except BaseException:
                self._con.execute("ROLLBACK")
                raise
            self._con.execute("COMMIT")
        return len(rows)

    def __len__(self) -> int:
        with self._lock:
            return self._con.execute("SELECT COUNT(*) FROM results").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._con.close()


_OPEN: dict[Path, ResultCache] = {}
_OPEN_LOCK = threading.Lock()


def open_cache(cache_dir: str | Path | None = None) -> ResultCache:
    """The process-wide ResultCache for `cache_dir` (None: the default dir), opened once."""
    path = (Path(cache_dir) if cache_dir is not None else default_cache_dir()).expanduser().resolve()
    with _OPEN_LOCK:
        if path not in _OPEN:
            _OPEN[path] = ResultCache(path)
        return _OPEN[path]
