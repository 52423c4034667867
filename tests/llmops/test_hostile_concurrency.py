"""Runs that share a result cache generate each row once between them: the second run waits for the rows the
first has claimed and serves them when they are stored; a claimant that died (a killed process, a silent host)
loses its claims to the next run. Coordinated with events, never with sleeps."""
from __future__ import annotations

import socket
import sqlite3
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq

import llmops.row_claims as row_claims
from helpers.fake_engine import FakeLLM
from helpers.paths import REPO, TESTS
from llmops.core import MapSpec, map_table
from llmops.pipeline.load import load_pipeline
from llmops.pipeline.runner import run_pipeline
from llmops.result_cache import CachedResult, ResultCache

ROWS = [f"row {i}" for i in range(10)]


class HeldFake(FakeLLM):
    """The fake engine, which says when it starts generating and then waits for `go` before its first block."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.started, self.go = threading.Event(), threading.Event()

    def stream(self, prompts, params=None):
        self.started.set()
        assert self.go.wait(120), "never released"
        yield from super().stream(prompts, params)


def test_two_concurrent_runs_of_one_pipeline_generate_each_row_once(tmp_path, monkeypatch):
    (tmp_path / "d.csv").write_text("b\n" + "\n".join(ROWS) + "\n")
    (tmp_path / "p.yaml").write_text(f"""\
cache_dir: {tmp_path / 'cache'}
source: {{csv: {tmp_path / 'd.csv'}}}
steps:
  - llm_map: {{output: o, template: "Say {{b}}"}}
sink: {{parquet: {tmp_path / 'out.parquet'}}}
""")
    pipeline = load_pipeline(tmp_path / "p.yaml")
    first, second = HeldFake(block_size=3), FakeLLM(block_size=3)
    waiting = threading.Event()
    real_wait = row_claims.Claim.wait

    def wait(self, keys):
        waiting.set()                          # the second run found every row claimed and waits for them
        return real_wait(self, keys)
    monkeypatch.setattr(row_claims.Claim, "wait", wait)
    results = {}
    runs = [threading.Thread(target=lambda name=name, eng=eng: results.__setitem__(
        name, run_pipeline(pipeline, engine=eng, progress=False))) for name, eng in (("a", first), ("b", second))]
    runs[0].start()
    assert first.started.wait(120)
    runs[1].start()
    assert waiting.wait(120)
    first.go.set()
    for t in runs:
        t.join(120)
    assert not any(t.is_alive() for t in runs) and set(results) == {"a", "b"}
    assert first.prompts_seen == len(ROWS) and second.prompts_seen == 0        # each row generated once in all
    assert results["b"].cache_hits == len(ROWS) and results["a"].cache_hits == 0
    assert pq.read_table(tmp_path / "out.parquet").column("o").to_pylist() == [f"echo: Say {r}" for r in ROWS]
    with sqlite3.connect(tmp_path / "cache" / "results.sqlite") as con:
        assert con.execute("SELECT COUNT(*) FROM claims").fetchone()[0] == 0     # every claim freed


def _owners(cache: ResultCache) -> list[tuple]:
    with cache.transaction() as con:
        return con.execute("SELECT key, owner, host, pid FROM claims ORDER BY key").fetchall()


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_claims_of_live_dead_and_silent_owners(tmp_path):
    cache = ResultCache(tmp_path)
    keys = ["k1", "k2", "k3"]
    live = row_claims.Claim(cache, keys[:2])
    assert live.mine == ["k1", "k2"] and live.theirs == []
    other = row_claims.Claim(cache, keys)
    assert (other.mine, other.theirs) == (["k3"], ["k1", "k2"])           # a live owner keeps its rows
    cache.put_many([("k1", CachedResult("one", "stop", 1, 1))])
    found, mine = other.wait(["k1", "k2"])
    assert set(found) == {"k1"} and mine == []                           # a stored row is served, not claimed
    live.release(["k2"])
    assert other.wait(["k2"]) == ({}, ["k2"])                            # a freed row is taken over
    live.close()
    other.close()
    assert _owners(cache) == []

    dead = row_claims.Claim(cache, ["k4"])
    dead._stop.set()                                                     # its heartbeat stops, as in a killed run
    with cache.transaction() as con:
        con.execute("UPDATE claims SET pid = ? WHERE owner = ?", (_dead_pid(), dead.owner))
    assert row_claims.Claim(cache, ["k4"]).mine == ["k4"]                # this host's dead process: taken over

    far = row_claims.Claim(cache, ["k5"])
    far._stop.set()
    with cache.transaction() as con:
        con.execute("UPDATE claims SET host = 'elsewhere', pid = 1 WHERE owner = ?", (far.owner,))
    assert row_claims.Claim(cache, ["k5"]).theirs == ["k5"]              # another host, heartbeat fresh: kept
    with cache.transaction() as con:
        con.execute("UPDATE claims SET heartbeat = ? WHERE owner = ?", (time.time() - row_claims.CLAIM_TTL - 1,
                                                                        far.owner))
    assert row_claims.Claim(cache, ["k5"]).mine == ["k5"]                # silent past the TTL: taken over


DYING = """\
import os, signal, sys
sys.path.append({tests!r})
import pyarrow as pa
from helpers.fake_engine import FakeLLM
from llmops.core import MapSpec, map_table

class Dying(FakeLLM):
    def stream(self, prompts, params=None):
        os.kill(os.getpid(), signal.SIGKILL)       # killed while it holds the claims of every row
        yield from ()

map_table(pa.table({{"b": {rows!r}}}), MapSpec("Say {{b}}"), engine=Dying(), cache_dir=sys.argv[1]).ordered()
"""


def test_a_killed_claimant_loses_its_rows_to_the_next_run(tmp_path):
    done = subprocess.run([sys.executable, "-c", DYING.format(tests=str(TESTS), rows=ROWS), str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == -9, done.stderr
    cache = ResultCache(tmp_path)
    held = _owners(cache)
    assert len(held) == len(ROWS) and all(host == socket.gethostname() for _, _, host, _ in held)
    eng = FakeLLM()
    run = map_table(pa.table({"b": ROWS}), MapSpec("Say {b}"), engine=eng, cache_dir=tmp_path)
    out = run.ordered()
    assert out.column("output").to_pylist() == [f"echo: Say {r}" for r in ROWS]
    assert eng.prompts_seen == len(ROWS) and _owners(cache) == []
