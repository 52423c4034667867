"""Semantic pipeline steps: load-time validation (errors name file:line, step and key) and runs on the fake
engine (llm_filter, llm_reduce, resolve, llm_join, llm_map with validate)."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from helpers.fake_engine import FakeLLM
from helpers.paths import REPO
from llmops.pipeline.load import PipelineError, dump_pipeline, load_pipeline
from llmops.pipeline.plan import plan_pipeline
from llmops.pipeline.spec import Pipeline
from llmops.pipeline.runner import run_pipeline
from llmops.pipeline.steps import StepError


def _write(tmp_path: Path, steps: str, source: str = "sample_data/customers_dupes.csv") -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(f"name: t\ncache_dir: false\nsource: {{csv: {REPO / source}}}\nsteps:\n{steps}\n"
                    f"sink: {{parquet: {tmp_path / 'out.parquet'}}}\n")
    return path


@pytest.mark.parametrize("steps, message", [
    ("  - llm_filter: {template: 'Bug? {body', reason: why}", r"p.yaml:5: steps\[0\].llm_filter: .*malformed template"),
    ("  - llm_filter: {template: 'x {body}', colour: red}", r"steps\[0\].llm_filter.colour: unknown key 'colour'; expected one of"),
    ("  - resolve: {columns: [name], blocking: {threshold: 2}}", r"steps\[0\].resolve.blocking.threshold: .*less than or equal to 1"),
    ("  - resolve: {columns: []}", r"steps\[0\].resolve.columns: .*at least 1"),
    ("  - llm_reduce: {by: [a], template: 'no placeholder'}", r"steps\[0\].llm_reduce: .*must contain \{rows\}"),
    ("  - llm_reduce: {by: [a], template: '{rows}', choices: [a], regex: 'a'}", r"at most one of schema, choices, regex"),
    ("  - llm_join: {right: 'SELECT 1', left_on: [a], right_on: [b, c]}", r"steps\[0\].llm_join: .*as many columns"),
    ("  - llm_join: {right: 'SELECT 1', left_on: [a], min_confidence: 0}", r"llm_join.min_confidence: .*greater than 0"),
    ("  - llm_map: {output: o, template: '{name}', validate: 'o >>> ('}", r"steps\[0\].llm_map.validate: .*not a DuckDB expression"),
    ("  - llm_map: {output: o, template: '{name}', max_attempts: true}", r"llm_map.max_attempts: expected a number"),
])
def test_bad_semantic_steps_fail_at_load_naming_step_and_key(tmp_path, steps, message):
    with pytest.raises(PipelineError, match=message):
        load_pipeline(_write(tmp_path, steps))


def test_resolve_step_runs_and_reports_pairs(tmp_path):
    path = _write(tmp_path, "  - resolve: {columns: [name, city], blocking: {threshold: 0.5}, id_column: id}")
    result = run_pipeline(load_pipeline(path), engine=FakeLLM(), progress=False)
    out = pq.read_table(tmp_path / "out.parquet").to_pydict()
    step = result.llm_steps[0]
    assert len(out["entity_id"]) == result.source_rows and set(out["entity_id"]) <= set(out["id"])
    assert step["compared_pairs"] < step["all_pairs"] and step["kind"] == "steps[0] (resolve)"


def test_filter_reduce_chain(tmp_path):
    steps = ("  - llm_filter: {template: 'Is this a bug? Yes or No: {body}'}\n"
             "  - llm_reduce: {by: [label], template: 'Summarise:\\n{rows}', item: '- {subject}', output: summary}")
    result = run_pipeline(load_pipeline(_write(tmp_path, steps, "sample_data/tickets.csv")), engine=FakeLLM(),
                          progress=False)
    out = pq.read_table(tmp_path / "out.parquet").to_pydict()
    assert sorted(out) == ["label", "summary", "summary_error"] and result.rows_written == len(out["label"])


def test_llm_join_step_reads_right_query(tmp_path):
    right = f"SELECT * FROM read_csv('{REPO / 'sample_data/products_right.csv'}', all_varchar = true) LIMIT 30"
    steps = f'  - llm_join: {{right: "{right}", left_on: [title], blocking: {{top_k: 2}}}}'
    result = run_pipeline(load_pipeline(_write(tmp_path, steps, "sample_data/products_left.csv")), engine=FakeLLM(),
                          progress=False, limit=30)
    out = pq.read_table(tmp_path / "out.parquet").to_pydict()
    assert {"id_right", "title_right", "confidence"} <= set(out) and result.llm_steps[0]["all_pairs"] == 900


def test_llm_join_step_unknown_column_names_step(tmp_path):
    steps = '  - llm_join: {right: "SELECT 1 AS x", left_on: [title]}'
    with pytest.raises(StepError, match=r"steps\[0\] \(llm_join\): llm_join \(right\): unknown column"):
        run_pipeline(load_pipeline(_write(tmp_path, steps, "sample_data/products_left.csv")), engine=FakeLLM(),
                     progress=False)


def test_llm_map_validate_counts_rejected_rows(tmp_path):
    steps = ("  - llm_map: {output: o, template: 'Say {name}', max_new_tokens: 4, validate: \"o LIKE '%zzz%'\",\n"
             "              max_attempts: 2, error_column: err}")
    result = run_pipeline(load_pipeline(_write(tmp_path, steps)), engine=FakeLLM(), progress=False, limit=5)
    out = pq.read_table(tmp_path / "out.parquet").to_pydict()
    assert out["o"] == [None] * 5 and all("fails validate rule" in e for e in out["err"])
    assert result.failed_rows == 5 and result.llm_steps[0]["retried"] == 5


SEMANTIC_PIPELINES = sorted((REPO / "pipelines" / "semantic").glob("*.yaml"))


@pytest.mark.parametrize("path", SEMANTIC_PIPELINES, ids=[p.stem for p in SEMANTIC_PIPELINES])
def test_semantic_sample_pipelines_round_trip_and_dry_run(path, tmp_path, monkeypatch):
    pipeline = load_pipeline(path)
    assert Pipeline.from_dict(pipeline.to_dict()) == pipeline
    (tmp_path / "again.yaml").write_text(dump_pipeline(pipeline))
    assert load_pipeline(tmp_path / "again.yaml") == pipeline
    monkeypatch.chdir(REPO)
    plan = plan_pipeline(pipeline, limit=60)    # the first 12 customers hold no duplicate: no pair to compare
    assert any(s.get("prompts", 0) > 0 for s in plan["steps"]) and plan["output_columns"]
