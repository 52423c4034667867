"""Progress moves per row as the engine reports rows finished (not per block), in map_table, Polars and
DuckDB, with one bar per job whose total grows by each call's rows."""
from __future__ import annotations

import duckdb
import polars as pl
import pyarrow as pa

from helpers.fake_engine import FakeLLM
from llmops import core
from llmops.core import MapSpec, map_table
from llmops.duckdb import register


class RowReportingLLM(FakeLLM):
    """A fake engine that reports each row finished (`on_finished`) before yielding its block."""

    def stream(self, prompts, params=None, on_finished=None):
        for group in super().stream(prompts, params):
            for idx, completion in group:
                if on_finished is not None:
                    on_finished(idx, completion)
            yield group


class Recorder:
    """Stands in for `llmops.progress.Progress`: records every call."""

    instances: list["Recorder"] = []

    def __init__(self, total, *, enabled=None, desc="llm_map"):
        self.total, self.steps, self.grown = total, [], []
        Recorder.instances.append(self)

    def grow(self, rows):
        self.grown.append(rows)

    def expect(self, rows, max_new_tokens, predicted_tokens_per_s=None):
        pass

    def step(self, tokens):
        pass

    def idle(self):
        pass

    def advance(self, rows, *, tokens=0, tokens_per_s=None):
        self.steps.append(("row", rows))

    def update(self, rows, **kw):
        self.steps.append(("block", rows))

    def close(self):
        pass


def _recorder(monkeypatch):
    Recorder.instances = []
    monkeypatch.setattr(core, "Progress", Recorder)


def test_bar_moves_per_finished_row(monkeypatch):
    _recorder(monkeypatch)
    table = pa.table({"body": [f"row {i}" for i in range(8)] + ["row 0"]})   # the last row is a duplicate
    run = map_table(table, MapSpec(template="{body}"), cache_dir=False, engine=RowReportingLLM(block_size=4),
                    progress=True)
    run.ordered()
    bar = Recorder.instances[0]
    rows = [n for kind, n in bar.steps if kind == "row"]
    assert bar.total == 9 and len(rows) == 8 and sum(rows) == 9            # the duplicate moves with its twin
    assert sum(n for _, n in bar.steps) == 9                              # blocks add nothing already shown


def test_engine_without_row_reports_moves_per_block(monkeypatch):
    _recorder(monkeypatch)
    table = pa.table({"body": [f"row {i}" for i in range(8)]})
    map_table(table, MapSpec(template="{body}"), cache_dir=False, engine=FakeLLM(block_size=4), progress=True).ordered()
    assert Recorder.instances[0].steps == [("block", 4), ("block", 4)]


def test_duckdb_and_polars_jobs_keep_one_growing_bar(monkeypatch):
    _recorder(monkeypatch)
    eng = RowReportingLLM(block_size=64)
    con = duckdb.connect()
    register(con, engine=eng, cache_dir=False, progress=True)
    con.sql("SELECT llm_map('{x}', 'v' || i::VARCHAR) FROM range(5000) t(i)").fetchall()
    bars = Recorder.instances
    assert len(bars) == 1 and bars[0].total + sum(bars[0].grown) == 5000
    assert sum(n for kind, n in bars[0].steps if kind == "row") == 5000
    Recorder.instances = []
    from llmops.polars import llm_map

    pl.DataFrame({"b": ["a", "b", "c"]}).select(llm_map("{b}", engine=eng, cache_dir=False, progress=True))
    assert len(Recorder.instances) == 1 and sum(n for _, n in Recorder.instances[0].steps) == 3


def test_real_bar_counts_rows(capsys):
    table = pa.table({"body": [f"row {i}" for i in range(6)]})
    map_table(table, MapSpec(template="{body}"), cache_dir=False, engine=RowReportingLLM(block_size=3),
              progress=True).ordered()
    err = capsys.readouterr().err
    assert "6/6" in err and "row" in err
