"""Row claims: runs that share a result cache generate each row once between them.

Before a run generates the rows its cache lookup missed, it claims them (`Claim(cache, keys)`): a row in the
`claims` table of the cache's SQLite file belongs to one run (an `owner` id, its host and pid, and a heartbeat
time). `mine` are the rows this run generates; `theirs` the rows another live run is generating. The run
generates its own rows, then `wait(theirs)` returns as soon as some of them are stored (served like cache
hits) or free again (claimed now by this run, to generate: the other run gave them up, e.g. error rows,
which are never stored).

A claim is stale, and is taken over, when its owner ran on this host and its process is gone (a `kill -9`),
or when its heartbeat is older than `CLAIM_TTL` seconds (an owner on another host that died); a live owner's
background thread renews the heartbeat of all its claims every `HEARTBEAT_SECONDS`. `release(keys)` frees
rows once they are stored (or failed); `close()` frees every row still claimed and stops the heartbeat.
Waiting polls the file, starting at `POLL_SECONDS[0]` and backing off to `POLL_SECONDS[1]`.
"""
from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence

from llmops.pids import pid_alive
from llmops.result_cache import CachedResult, ResultCache

CLAIM_TTL = 60.0              # seconds without a heartbeat after which a claim is stale
HEARTBEAT_SECONDS = 5.0       # how often a live owner renews its claims
POLL_SECONDS = (0.02, 1.0)    # first and longest pause between two looks at rows another run generates
_CHUNK = 500
_SCHEMA = """CREATE TABLE IF NOT EXISTS claims (
    key TEXT PRIMARY KEY, owner TEXT NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL, heartbeat REAL NOT NULL)"""


def _chunks(keys: Sequence[str]) -> list[list[str]]:
    return [list(keys[i:i + _CHUNK]) for i in range(0, len(keys), _CHUNK)]


class Claim:
    """One run's claims on rows of one result cache (see module docstring). Thread-safe."""

    def __init__(self, cache: ResultCache, keys: Sequence[str]) -> None:
        self.cache = cache
        self.owner = uuid.uuid4().hex
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.mine, self.theirs = self._take(list(keys))
        if self.mine:
            self._start()

    def _take(self, keys: list[str]) -> tuple[list[str], list[str]]:
        """Claim the free and stale ones of `keys` (in one transaction per chunk); (claimed now, held by
        another live run or already stored)."""
        mine: set[str] = set()
        now = time.time()
        for chunk in _chunks(keys):
            marks = ",".join("?" * len(chunk))
            with self.cache.transaction() as con:
                con.execute(_SCHEMA)
                stored = {k for (k,) in con.execute(f"SELECT key FROM results WHERE key IN ({marks})", chunk)}
                held = con.execute(f"SELECT key, owner, host, pid, heartbeat FROM claims WHERE key IN ({marks})",
                                   chunk).fetchall()
                stale = [k for k, owner, host, pid, beat in held if owner != self.owner and (
                    now - beat > CLAIM_TTL or (host == self.host and pid != self.pid and not pid_alive(pid)))]
                con.executemany("DELETE FROM claims WHERE key = ?", [(k,) for k in stale])
                free = [k for k in chunk if k not in stored]
                con.executemany("INSERT OR IGNORE INTO claims VALUES (?, ?, ?, ?, ?)",
                                [(k, self.owner, self.host, self.pid, now) for k in free])
                mine.update(k for (k,) in con.execute(
                    f"SELECT key FROM claims WHERE owner = ? AND key IN ({marks})", [self.owner, *chunk]))
        return [k for k in keys if k in mine], [k for k in keys if k not in mine]

    def wait(self, keys: Sequence[str]) -> tuple[dict[str, CachedResult], list[str]]:
        """Block until some of `keys` (rows other runs claimed) are stored or free; (their stored results, the
        keys this run claimed now and must generate). Returns at once when `keys` is empty."""
        pause = POLL_SECONDS[0]
        while keys:
            found = self.cache.get_many(keys)
            mine, _ = self._take([k for k in keys if k not in found])
            if found or mine:
                if mine:
                    self._start()
                return found, mine
            self._stop.wait(pause)
            pause = min(pause * 2, POLL_SECONDS[1])
        return {}, []

    def release(self, keys: Sequence[str]) -> None:
        """Free this run's claims on `keys` (stored, or given up)."""
        for chunk in _chunks(keys):
            with self.cache.transaction() as con:
                con.execute(f"DELETE FROM claims WHERE owner = ? AND key IN ({','.join('?' * len(chunk))})",
                            [self.owner, *chunk])

    def close(self) -> None:
        """Free every claim of this run and stop its heartbeat."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self.cache.transaction() as con:
            con.execute(_SCHEMA)
            con.execute("DELETE FROM claims WHERE owner = ?", (self.owner,))

    def _start(self) -> None:
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._beat, name="llmops-row-claims", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                with self.cache.transaction() as con:
                    con.execute("UPDATE claims SET heartbeat = ? WHERE owner = ?", (time.time(), self.owner))
            except Exception:  # noqa: BLE001 (a missed heartbeat is retried; only a long silence loses claims)
                continue
