"""benchmarks/operators/job_paths.py: a fresh-process path runs with the benchmark's own engine closed, and the
next in-process path finds it built again (untimed) first."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: `benchmarks.*`
from benchmarks.operators import job_paths  # noqa: E402

RUNNERS = ("run_engine", "run_pipeline", "run_pipeline_dry", "run_pipeline_first", "run_pipeline_cold", "run_polars",
           "run_polars_streaming", "run_duckdb_relation", "run_duckdb_udf")


def _run(monkeypatch, tmp_path, order: list[str], interleave: bool = False) -> list[str]:
    events: list[str] = []
    job = SimpleNamespace(llm="engine", rows=[], **{name: (lambda: {}) for name in RUNNERS})
    monkeypatch.setattr(job_paths, "close_and_release", lambda llm: events.append(f"release {llm}"))
    monkeypatch.setattr(job_paths, "print_progress", lambda record, rows: None)
    monkeypatch.setattr(job_paths, "run_path", lambda job, path, runner, common, n, repeat, rates:
                        events.append(path) or {"run_id": "r", "order": n, "path": path, "rows_per_h": 1.0})
    job_paths.run_all(job, order, {"run_id": "r"}, tmp_path / "out.jsonl", interleave,
                      lambda: events.append("rewarm"))
    return events


def test_the_engine_is_released_before_fresh_processes_and_rewarmed_after(monkeypatch, tmp_path):
    events = _run(monkeypatch, tmp_path, ["engine", "pipeline-first", "pipeline-cold", "polars", "pipeline-dry"])
    assert events == ["engine", "release engine", "pipeline-first", "pipeline-cold", "rewarm", "polars",
                      "release engine", "pipeline-dry"]


def test_interleaved_engine_runs_around_a_cold_run_find_the_engine_built(monkeypatch, tmp_path):
    order = job_paths.path_order(["engine", "pipeline-cold"], interleave=True, engine_again=False)
    events = _run(monkeypatch, tmp_path, order, interleave=True)
    assert events == ["engine", "release engine", "pipeline-cold", "rewarm", "engine"]
