"""Durability per row: rows are stored as they finish (decoder hook -> LLM.stream(on_finished) -> RowWriter),
the cache survives concurrent and killed writers, and a pipeline killed with SIGKILL mid-run resumes to the
uninterrupted run's output with every row once, recomputing at most the rows in flight."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from engine import LLM, Policy, SamplingParams
from engine.decoding.decoder import BlockDecoder
from engine.decoding.params import Completion
from helpers.cache_writer import write_rows
from helpers.paths import REPO
from llmops import core
from llmops.result_cache import CachedResult, ResultCache, RowWriter

DEADLINE_S = 60.0     # how long a poll for a state may wait before the test fails (never a timing assert)


def _poll(check, what: str, proc: subprocess.Popen | None = None) -> None:
    """Wait until `check()` is true (fail after DEADLINE_S, or when `proc` exits first)."""
    end = time.monotonic() + DEADLINE_S
    while not check():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}: "
                                 f"{proc.stderr.read() if proc.stderr else ''}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _stored(cache_dir: Path) -> int:
    """Rows in a result cache file, read through a connection of our own (0 before the table exists)."""
    path = cache_dir / "results.sqlite"
    if not path.exists():
        return 0
    con = sqlite3.connect(path, timeout=60)
    try:
        return con.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    except sqlite3.OperationalError:
        return 0
    finally:
        con.close()


# ---- the decoder's row-finish hook ---------------------------------------------------------------------
def test_decoder_reports_each_row_when_it_finishes():
    """Row r is forced to EOS at step r: it is reported by that step's call, with the Completion that
    `completions()` returns later; a row the executor never reached is not reported."""
    vocab, eos, rows = 16, 2, 4
    events: list[tuple[int, int]] = []
    reported: dict[int, Completion] = {}
    step = 0

    def on_finished(row: int, c: Completion) -> None:
        events.append((step, row))
        reported[row] = c

    dec = BlockDecoder([[1]] * rows, [10] * rows, SamplingParams(max_new_tokens=10), eos_ids={eos},
                       on_finished=on_finished)
    alive = [0, 1, 2]                       # row 3 is never fed (a row the executor did not reach)
    while alive:
        logits = torch.zeros(len(alive), vocab)
        for i, row in enumerate(alive):
            logits[i, eos if row == step else 5] = 1.0
        _, finished = dec(alive, logits)
        alive = [r for r, f in zip(alive, finished) if not f]
        step += 1
    assert events == [(0, 0), (1, 1), (2, 2)]
    out = dec.completions()
    assert all(out[r] is reported[r] for r in range(3)) and 3 not in reported
    assert [c.finish_reason for c in out] == ["stop", "stop", "stop", "length"]
    assert [len(c.token_ids) for c in out[:3]] == [1, 2, 3]


def test_stream_reports_rows_before_their_block_is_yielded(tiny_llama):
    prompts = [f"order {i} amount {i}.50" for i in range(10)]
    params = SamplingParams(max_new_tokens=6, stop=("e",))
    events: list[tuple[str, int]] = []
    reported: dict[int, Completion] = {}

    def on_finished(index: int, c: Completion) -> None:
        events.append(("finished", index))
        reported[index] = c

    with LLM(tiny_llama, dtype="float32", device="cpu", policy=Policy(gpu_batch_size=4)) as llm:
        yielded = {}
        for group in llm.stream(prompts, params, on_finished=on_finished):
            events += [("yielded", i) for i, _ in group]
            yielded.update(group)
        plain = llm.generate(prompts, params)
    assert sorted(yielded) == list(range(10)) and sorted(reported) == list(range(10))
    for i in range(10):
        assert events.index(("finished", i)) < events.index(("yielded", i))
        assert yielded[i] is reported[i] and yielded[i] == plain[i]      # same completions as without the hook


# ---- RowWriter and the cache under concurrency ---------------------------------------------------------
def test_row_writer_stores_within_its_delay_without_a_block_end(tmp_path):
    cache = ResultCache(tmp_path)
    writer = RowWriter(cache, max_delay=0.05)
    writer.add("k1", CachedResult("a", "stop", 3, 1))
    writer.add("bad", CachedResult("", "error", 3, 0))
    _poll(lambda: _stored(tmp_path) == 1, "the background flush")   # another connection sees it
    writer.close()
    assert cache.get_many(["k1", "bad"]) == {"k1": CachedResult("a", "stop", 3, 1)}


def test_row_writer_flushes_by_size_and_block_end_skips_rows_already_added(tmp_path, monkeypatch):
    cache = ResultCache(tmp_path)
    puts: list[list[str]] = []
    real = cache.put_many

    def spy(items, about=None):
        items = list(items)
        puts.append(sorted(k for k, _ in items))
        return real(items, about)

    monkeypatch.setattr(cache, "put_many", spy)
    cache_items = {f"k{i}": CachedResult(str(i), "stop", 1, 1) for i in range(4)}
    writer = RowWriter(cache, max_delay=3600, max_rows=2)
    writer.add("k0", cache_items["k0"])
    assert puts == []
    writer.add("k1", cache_items["k1"])
    _poll(lambda: puts == [["k0", "k1"]], "the size flush")   # two waiting rows: the writer thread stores them
    writer.add("k2", cache_items["k2"])
    changed = CachedResult("other", "stop", 1, 1)
    cache_items["k1"] = changed                        # e.g. a block retried after an out-of-memory
    writer.finish_block([("k0", CachedResult("0", "stop", 1, 1)), ("k1", changed), ("k2", cache_items["k2"]),
                         ("k3", cache_items["k3"])])
    assert puts[1:] == [["k1", "k2", "k3"]]
    writer.close()
    assert len(cache) == 4 and cache.get_many(["k1"])["k1"] == changed


def test_concurrent_writer_processes_never_corrupt_the_cache(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=write_rows, args=(str(tmp_path), tag, 60)) for tag in "abc"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    con = sqlite3.connect(tmp_path / "results.sqlite")
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert con.execute("SELECT COUNT(*) FROM results").fetchone()[0] == 3 * 60 * 5


def test_a_writer_killed_mid_write_leaves_a_sound_cache(tmp_path):
    code = ("import sys; sys.path.insert(0, 'tests'); from helpers.cache_writer import write_rows; "
            f"write_rows({str(tmp_path)!r}, 'k', 100000)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True)
    _poll(lambda: _stored(tmp_path) >= 50, "rows from the writer", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    cache = ResultCache(tmp_path)
    n = len(cache)
    assert n >= 50 and n % 5 == 0                     # whole transactions only
    assert cache._con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    cache.put_many([("after", CachedResult("x", "stop", 1, 1))])
    assert len(cache) == n + 1


# ---- MapRun stores rows the engine reports, before the block ends --------------------------------------
class ReportingEngine:
    """An engine whose only block reports each row as finished, then waits until the rows are in the cache
    file (read by another connection) before it yields the block: it passes only if the operator layer
    stored the rows at once, not at the block end."""

    fingerprint = "reporting-v1"

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.stored_before_yield = -1

    def stream(self, prompts, params, *, on_finished=None):
        group = [(i, Completion(f"out {i}", [5, 6], "stop", 3)) for i in range(len(prompts))]
        for i, c in group:
            on_finished(i, c)
        _poll(lambda: _stored(self.cache_dir) == len(prompts), "rows stored before their block ended")
        self.stored_before_yield = _stored(self.cache_dir)
        yield group


def test_map_run_stores_reported_rows_before_the_block_ends(tmp_path):
    import pyarrow as pa

    eng = ReportingEngine(tmp_path)
    table = pa.table({"x": [f"row {i}" for i in range(5)]})
    out = core.map_table_ordered(table, core.MapSpec("Say {x}"), cache_dir=tmp_path, engine=eng)
    assert eng.stored_before_yield == 5 and out.column("output").to_pylist() == [f"out {i}" for i in range(5)]
    again = core.map_table(table, core.MapSpec("Say {x}"), cache_dir=tmp_path, engine=eng)
    again.ordered()
    assert again.summary.cache_hits == 5 and again.summary.generated_rows == 0


# ---- the crash test: a pipeline killed with SIGKILL mid-run, then rerun --------------------------------
ROWS, KILL_AFTER = 40, 8
# `llmops run` with small blocks: pipeline YAML takes only policy "auto", so the launcher sets the real
# engine's policy through the engine factory (4 rows per block: 10 blocks, the kill lands between them).
LAUNCHER = """\
import sys
from engine import LLM, Policy
from llmops import engines
engines.set_factory(lambda model, **settings: LLM(model, **{**settings, "policy": Policy(gpu_batch_size=4)}))
from llmops.cli import main
sys.argv = ["llmops", *sys.argv[1:]]
main()
"""
PIPELINE = """\
name: crash
model: {model}
engine: {{dtype: float32, device: cpu}}
cache_dir: {cache}
source: {{csv: {csv}}}
steps:
  - llm_map: {{output: out, template: "Extract the amount from: {{body}}", max_new_tokens: 160}}
  - select: [id, out]
sink: {{parquet: {sink}}}
"""


@pytest.fixture
def crash_setup(tiny_llama, tmp_path):
    rows = ["id,body"] + [f"{i},order {i} amount {i * 7 % 100}.50 EUR for customer {i % 9}" for i in range(ROWS)]
    (tmp_path / "in.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "launch.py").write_text(LAUNCHER)

    def pipeline(name: str) -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(PIPELINE.format(model=tiny_llama, cache=tmp_path / f"cache-{name}", csv=tmp_path / "in.csv",
                                        sink=tmp_path / f"{name}.parquet"))
        return path

    return tmp_path, pipeline


def _command(tmp_path: Path, pipeline: Path) -> list[str]:
    return [sys.executable, str(tmp_path / "launch.py"), "run", str(pipeline), "--json", "--no-progress"]


# One intra-op thread: the tiny model gains nothing from two, and on a loaded machine OpenMP's barrier
# between two threads can make each decode step ~20x slower.
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _run(tmp_path: Path, pipeline: Path) -> dict:
    out = subprocess.run(_command(tmp_path, pipeline), cwd=tmp_path, env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_pipeline_killed_mid_run_resumes_to_the_same_output(crash_setup):
    tmp_path, pipeline = crash_setup
    reference = _run(tmp_path, pipeline("reference"))
    assert reference["cache_hits"] == 0 and reference["rows_written"] == ROWS

    crashed = pipeline("crashed")
    proc = subprocess.Popen(_command(tmp_path, crashed), cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    cache = tmp_path / "cache-crashed"
    _poll(lambda: _stored(cache) >= KILL_AFTER, f"{KILL_AFTER} stored rows", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before the kill: make it longer"
    persisted = _stored(cache)
    assert KILL_AFTER <= persisted < ROWS and not (tmp_path / "crashed.parquet").exists()

    resumed = _run(tmp_path, crashed)
    step = resumed["llm_steps"][0]
    assert resumed["cache_hits"] >= persisted                       # at most the rows in flight recomputed
    assert step["cache_hits"] + step["generated_rows"] == ROWS and step["generated_rows"] <= ROWS - persisted
    got = pq.read_table(tmp_path / "crashed.parquet").to_pylist()
    want = pq.read_table(tmp_path / "reference.parquet").to_pylist()
    assert [r["id"] for r in got] == list(range(ROWS))             # every row exactly once, in input order
    assert got == want
    assert not list(tmp_path.glob("crashed.parquet.llmops-partial-*"))   # the killed run's staging is gone

    again = _run(tmp_path, crashed)                                  # an unchanged rerun: all cache hits
    assert again["cache_hits"] == ROWS and again["generated_tokens"] == 0
