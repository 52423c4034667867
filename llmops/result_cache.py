"""Result cache: finished generations persisted in one SQLite file so reruns compute only what is missing.

A row's key is sha256 over (model fingerprint, rendered prompt, sampling params), see `result_key`; the
engine's fingerprint covers weights, tokenizer, chat template, dtype, compression and its numerics version.
Each `put_many` call is one transaction: its rows are either all on disk or none are, and a crash never
leaves a partial row. `RowWriter` is how a run stores rows as they finish: small groups, each a
transaction, at most `FLUSH_SECONDS` after a row finished (or sooner, every `FLUSH_ROWS` rows), so a
`kill -9` loses at most the rows of the last second, not a whole block.

Concurrency: SQLite's WAL journal lets readers and writers of several threads and processes share the file;
a writer waits up to 60 s for another's transaction (busy timeout) instead of failing, and a killed writer's
uncommitted transaction is rolled back by the next opener, so the file is never corrupt. Two runs over the
same rows do not claim them: each may compute a row the other is computing, and the last to finish stores
it (equal keys, equal results for greedy decoding). Every method is thread-safe. Completions whose
finish_reason is "error" are not stored (a rerun retries them).
"""
from __future__ import annotations

import hashlib
import json
import logging
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
FLUSH_SECONDS = 1.0   # a finished row reaches the file at most this long after it finished
FLUSH_ROWS = 256      # ... or as soon as this many rows wait
log = logging.getLogger(__name__)


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


class RowWriter:
    """Stores a run's rows as they finish, in small groups (see the module docstring). Thread-safe.

    `add(key, result)`: a row finished early (the engine's row-finish hook, on the decode loop: it never
    stores there); the background thread stores it within `max_delay` seconds, or as soon as `max_rows`
    rows wait. `finish_block(items)`:
    a block was yielded; its rows not already added with an equal result are added, and everything waiting
    is stored now (the block is on disk when it returns; a failure to store raises here). `close()` stores
    what waits and stops the thread. A failed background store keeps the rows waiting for the next try.
    """

    def __init__(self, cache: ResultCache, *, max_delay: float | None = None, max_rows: int | None = None) -> None:
        self.cache = cache
        self.max_delay = FLUSH_SECONDS if max_delay is None else max_delay
        self.max_rows = FLUSH_ROWS if max_rows is None else max_rows
        self._waiting: dict[str, CachedResult] = {}
        self._added: dict[str, CachedResult] = {}     # rows added early, until their block is yielded
        self._lock = threading.Lock()
        self._io = threading.Lock()                  # one store at a time, in order
        self._stop = threading.Event()
        self._wake = threading.Event()               # set by `add` when `max_rows` rows wait, or by `close`
        self._thread: threading.Thread | None = None
        self.stored = 0

    def add(self, key: str, result: CachedResult) -> None:
        if result.finish_reason == "error":
            return
        with self._lock:
            self._added[key] = result
            self._waiting[key] = result
            if self._thread is None:
                self._thread = threading.Thread(target=self._tick, name="llmops-row-writer", daemon=True)
                self._thread.start()
            if len(self._waiting) >= self.max_rows:
                self._wake.set()

    def finish_block(self, items: Iterable[tuple[str, CachedResult]]) -> None:
        with self._lock:
            for key, result in items:
                if self._added.pop(key, None) != result and result.finish_reason != "error":
                    self._waiting[key] = result
        self.flush()

    def flush(self) -> int:
        """Store every waiting row now (one transaction); returns how many were stored."""
        with self._io:
            with self._lock:
                rows, self._waiting = self._waiting, {}
            if not rows:
                return 0
            try:
                n = self.cache.put_many(rows.items())
            except BaseException:
                with self._lock:
                    self._waiting = {**rows, **self._waiting}
                raise
            self.stored += n
            return n

    def _tick(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.max_delay)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.flush()
            except Exception as exc:  # noqa: BLE001 (kept waiting; finish_block/close raise it)
                log.warning("result cache %s: storing finished rows failed (%s); will retry", self.cache.path, exc)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()


_OPEN: dict[Path, ResultCache] = {}
_OPEN_LOCK = threading.Lock()


def open_cache(cache_dir: str | Path | None = None) -> ResultCache:
    """The process-wide ResultCache for `cache_dir` (None: the default dir), opened once."""
    path = (Path(cache_dir) if cache_dir is not None else default_cache_dir()).expanduser().resolve()
    with _OPEN_LOCK:
        if path not in _OPEN:
            _OPEN[path] = ResultCache(path)
        return _OPEN[path]
