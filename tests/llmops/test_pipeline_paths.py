"""Relative paths in a pipeline file are relative to the file's folder, whatever the working directory; paths
from the environment and `--set` are taken as given; the sample pipelines run from anywhere (fake engine)."""
from __future__ import annotations

import os

import pyarrow.parquet as pq
from click.testing import CliRunner

from helpers.paths import REPO
from llmops.cli import main
from llmops.pipeline.load import load_pipeline
from llmops.pipeline.runner import run_pipeline

PIPE = """\
cache_dir: cache
source: {{csv: "{source}"}}
steps:
  - llm_map: {{output: o, template: "Say {{body}}"}}
sink: {{parquet: "{sink}"}}
"""


def _layout(tmp_path, source: str, sink: str = "out/result.parquet"):
    """tmp/data/in.csv, tmp/jobs/p.yaml naming `source` and `sink`, and tmp/elsewhere as the working dir."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "in.csv").write_text("id,body\n1,hi\n2,there\n")
    (tmp_path / "jobs").mkdir()
    (tmp_path / "elsewhere").mkdir()
    pipe = tmp_path / "jobs" / "p.yaml"
    pipe.write_text(PIPE.format(source=source, sink=sink))
    return pipe


def test_relative_paths_are_relative_to_the_file(tmp_path, monkeypatch, fake):
    pipe = _layout(tmp_path, "../data/in.csv")
    monkeypatch.chdir(tmp_path / "elsewhere")
    pipeline = load_pipeline(os.path.relpath(pipe))
    assert pipeline.source.csv == str(tmp_path / "data" / "in.csv")
    assert pipeline.sink.parquet == str(tmp_path / "jobs" / "out" / "result.parquet")
    assert pipeline.cache_dir == str(tmp_path / "jobs" / "cache")
    result = run_pipeline(pipeline, progress=False)
    assert result.rows_written == 2 and pq.read_table(tmp_path / "jobs" / "out" / "result.parquet").num_rows == 2
    assert not (tmp_path / "elsewhere" / "out").exists()


def test_environment_and_set_paths_are_taken_as_given(tmp_path, monkeypatch):
    pipe = _layout(tmp_path, "${IN_CSV}", sink="${OUT:-out/default.parquet}")
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setenv("IN_CSV", "in.csv")
    pipeline = load_pipeline(pipe, overrides=["cache_dir=here"])
    assert pipeline.source.csv == "in.csv" and pipeline.cache_dir == "here"     # the working directory's
    assert pipeline.sink.parquet == str(tmp_path / "jobs" / "out" / "default.parquet")   # the file's default
    monkeypatch.setenv("OUT", "/abs/x.parquet")
    assert load_pipeline(pipe).sink.parquet == "/abs/x.parquet"


def test_a_sample_pipeline_runs_from_another_folder(tmp_path, monkeypatch, fake):
    monkeypatch.chdir(tmp_path)
    path = os.path.relpath(REPO / "pipelines" / "classify_tickets.yaml")
    result = CliRunner().invoke(main, ["run", path, "--dry-run", "--limit", "3"])
    assert result.exit_code == 0, result.output
    assert str(REPO / "sample_data" / "tickets.csv") in result.stdout
