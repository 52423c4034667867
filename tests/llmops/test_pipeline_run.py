"""Running pipelines on the fake engine: order, streaming, sinks, sources, steps, kill-and-resume, errors;
and every sample pipeline end to end on the embedded model (a few rows)."""
from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers.fake_engine import FakeLLM
from helpers.fake_pipeline import fake_engine_report
from helpers.paths import REPO
from helpers.skips import requires_smollm2
from llmops.pipeline import sinks
from llmops.pipeline.load import load_pipeline
from llmops.pipeline.plan import format_plan, plan_pipeline
from llmops.pipeline.runner import run_pipeline
from llmops.pipeline.sources import SourceError
from llmops.pipeline.spec import Pipeline
from llmops.pipeline.steps import StepError
from llmops.templates import TemplateError

N = 10


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """A 10-row ticket CSV (ids 1..10, with a duplicate body at rows 3 and 8)."""
    rows = ["id,subject,body,label"]
    for i in range(1, N + 1):
        body = "same billing text" if i in (3, 8) else f"ticket {i} about billing" if i % 2 else f"ticket {i} bug"
        rows.append(f"{i},subject {i},{body},{'billing' if i % 2 else 'bug'}")
    path = tmp_path / "tickets.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def _pipeline(tmp_path: Path, data: Path, *, steps: list | None = None, sink: dict | None = None,
              source: dict | None = None) -> Pipeline:
    return Pipeline.from_dict({
        "name": "t", "cache_dir": str(tmp_path / "cache"),
        "source": source or {"csv": str(data)},
        "steps": steps if steps is not None else [
            {"llm_map": {"output": "category", "template": "Classify: {body}", "choices": ["bug", "billing", "other"]}},
            {"select": ["id", "category"]}],
        "sink": sink or {"parquet": str(tmp_path / "out" / "result.parquet")},
    })


def _read(path: Path) -> dict:
    return pq.read_table(path).to_pydict()


def test_run_writes_rows_in_input_order(tmp_path, data):
    engine = FakeLLM(block_size=3)
    result = run_pipeline(_pipeline(tmp_path, data), engine=engine)
    out = _read(tmp_path / "out" / "result.parquet")
    assert out["id"] == list(range(1, N + 1))
    assert out["category"] == ["billing" if i % 2 or i == 8 else "bug" for i in range(1, N + 1)]
    assert result.rows_written == N and result.source_rows == N and result.failed_rows == 0
    assert engine.prompts_seen == N - 1  # two rows share a prompt
    assert not (tmp_path / "out" / "result.parquet.llmops-partial.parquet").exists()


def test_results_stream_to_the_sink_per_block(tmp_path, data, monkeypatch):
    writes: list[int] = []
    original = sinks.SinkWriter.write

    def spy(self, table):
        writes.append(table.num_rows)
        original(self, table)

    monkeypatch.setattr(sinks.SinkWriter, "write", spy)
    run_pipeline(_pipeline(tmp_path, data), engine=FakeLLM(block_size=4))
    assert len(writes) == 3 and sum(writes) == N  # 9 distinct prompts in blocks of 4, 4, 1 (+ a shared row)


def test_kill_and_resume_loses_and_duplicates_nothing(tmp_path, data):
    pipeline = _pipeline(tmp_path, data)
    target = tmp_path / "out" / "result.parquet"
    with pytest.raises(RuntimeError, match="crashed at block 2"):
        run_pipeline(pipeline, engine=FakeLLM(block_size=3, fail_at_block=2))
    assert not target.exists()
    assert not (tmp_path / "out" / "result.parquet.llmops-partial.parquet").exists()
    engine = FakeLLM(block_size=3)
    result = run_pipeline(pipeline, engine=engine)
    out = _read(target)
    assert out["id"] == list(range(1, N + 1))  # every row once, in order
    assert engine.prompts_seen == (N - 1) - 2 * 3  # the two finished blocks came from the cache
    assert result.cache_hits >= 6


def test_failed_run_leaves_previous_output_untouched(tmp_path, data):
    pipeline = _pipeline(tmp_path, data)
    run_pipeline(pipeline, engine=FakeLLM())
    target = tmp_path / "out" / "result.parquet"
    before = target.read_bytes()
    with pytest.raises(RuntimeError):
        run_pipeline(pipeline, engine=FakeLLM(fail_at_block=0), use_cache=False)
    assert target.read_bytes() == before


def test_no_cache_recomputes_everything(tmp_path, data):
    pipeline = _pipeline(tmp_path, data)
    run_pipeline(pipeline, engine=FakeLLM())
    engine = FakeLLM()
    result = run_pipeline(pipeline, engine=engine, use_cache=False)
    assert engine.prompts_seen == N - 1 and result.cache_hits == 0


def test_limit_reads_first_rows(tmp_path, data):
    result = run_pipeline(_pipeline(tmp_path, data), engine=FakeLLM(), limit=3)
    assert _read(tmp_path / "out" / "result.parquet")["id"] == [1, 2, 3] and result.source_rows == 3


def test_dry_run_generates_nothing_and_renders_a_prompt(tmp_path, data):
    engine = FakeLLM()
    plan = plan_pipeline(_pipeline(tmp_path, data), limit=5)
    text = format_plan(plan)
    assert engine.calls == 0 and engine.prompts_seen == 0
    assert "Classify: ticket 1 about billing" in text and plan["output_columns"] == ["id", "category"]
    assert plan["sink"]["streaming"] is True and not (tmp_path / "out").exists()


def test_structured_output_unnest_parse_filter_and_error_column(tmp_path, data):
    steps = [
        {"llm_map": {"output": "f", "template": "{body}", "schema": {"n": "integer", "s": "string"},
                     "unnest": "x_", "error_column": "err"}},
        {"parse": {"x_n": "string"}},
        {"filter": "id <> 2"},
        {"select": {"ident": "id", "n": "x_n", "s": "upper(x_s)", "err": "err"}},
    ]
    run_pipeline(_pipeline(tmp_path, data, steps=steps), engine=FakeLLM())
    table = pq.read_table(tmp_path / "out" / "result.parquet")
    assert table.column_names == ["ident", "n", "s", "err"]
    assert table["ident"].to_pylist() == [i for i in range(1, N + 1) if i != 2]
    assert table.schema.field("n").type == pa.string() and all(v is not None for v in table["n"].to_pylist())
    assert all(v.startswith("S-") for v in table["s"].to_pylist())  # the fake's "s-<n>", upper-cased


def test_cut_structured_rows_are_counted_as_failed(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("id,body\n1,fine\n2,CUT here\n3,ok\n")
    steps = [{"llm_map": {"output": "f", "template": "{body}", "schema": {"n": "integer"}, "error_column": "e"}}]
    result = run_pipeline(_pipeline(tmp_path, path, steps=steps), engine=FakeLLM())
    out = _read(tmp_path / "out" / "result.parquet")
    assert result.failed_rows == 1 and out["f"][1] is None and out["f"][0] is not None
    assert out["e"] == [None, "output cut by max_new_tokens=64 before the JSON was complete", None]


def test_sql_and_dedupe_after_llm_map_collect_then_run(tmp_path, data):
    steps = [
        {"llm_map": {"output": "category", "template": "{body}", "choices": ["bug", "billing"]}},
        {"dedupe": ["body"]},
        {"sql": "SELECT id, category FROM input ORDER BY id DESC"},
    ]
    run_pipeline(_pipeline(tmp_path, data, steps=steps), engine=FakeLLM(block_size=2))
    out = _read(tmp_path / "out" / "result.parquet")
    assert out["id"] == [i for i in range(N, 0, -1) if i != 8]  # the sql's order wins; row 8 duplicates row 3


def test_two_llm_maps_and_no_llm_map(tmp_path, data):
    steps = [
        {"llm_map": {"output": "a", "template": "{subject}", "max_new_tokens": 3}},
        {"llm_map": {"output": "b", "template": "{a}", "max_new_tokens": 8}},
    ]
    run_pipeline(_pipeline(tmp_path, data, steps=steps), engine=FakeLLM())
    out = _read(tmp_path / "out" / "result.parquet")
    assert out["a"][0] == "echo: subject 1" and out["b"][0] == "echo: echo: subject 1"
    run_pipeline(_pipeline(tmp_path, data, steps=[{"filter": "id > 7"}]), engine=FakeLLM())
    assert _read(tmp_path / "out" / "result.parquet")["id"] == [8, 9, 10]


def test_empty_input_writes_an_empty_table_with_columns(tmp_path, data):
    steps = [{"filter": "id > 100"},
             {"llm_map": {"output": "category", "template": "{body}", "choices": ["bug", "billing"]}}]
    result = run_pipeline(_pipeline(tmp_path, data, steps=steps), engine=FakeLLM())
    table = pq.read_table(tmp_path / "out" / "result.parquet")
    assert table.num_rows == 0 and "category" in table.column_names and result.rows_written == 0


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_file_sinks(tmp_path, data, kind):
    target = tmp_path / "out" / f"r.{kind}"
    run_pipeline(_pipeline(tmp_path, data, sink={kind: str(target)}), engine=FakeLLM())
    text = target.read_text().splitlines()
    if kind == "csv":
        assert text[0] == "id,category" and len(text) == N + 1 and text[1:3] == ["1,billing", "2,bug"]
    else:
        assert len(text) == N and json.loads(text[0]) == {"id": 1, "category": "billing"}


def test_duckdb_sink_replace_append_and_crash(tmp_path, data):
    db = tmp_path / "out.duckdb"
    sink = {"database": str(db), "table": "labels", "mode": "append"}
    pipeline = _pipeline(tmp_path, data, sink=sink)
    run_pipeline(pipeline, engine=FakeLLM(block_size=3))
    with pytest.raises(RuntimeError):
        run_pipeline(pipeline, engine=FakeLLM(block_size=3, fail_at_block=0), use_cache=False)

    def count() -> tuple:
        con = duckdb.connect(str(db), read_only=True)
        try:
            return con.execute("SELECT count(*), min(id) FROM labels").fetchall()[0]
        finally:
            con.close()

    assert count() == (N, 1)  # the crashed append added nothing
    run_pipeline(pipeline, engine=FakeLLM())
    assert count() == (2 * N, 1)
    run_pipeline(_pipeline(tmp_path, data, sink={**sink, "mode": "replace"}), engine=FakeLLM())
    assert count() == (N, 1)


def test_sources_parquet_jsonl_query_and_table(tmp_path, data):
    con = duckdb.connect(str(tmp_path / "src.duckdb"))
    con.execute("CREATE TABLE t AS SELECT * FROM read_csv_auto(?)", [str(data)])
    con.execute(f"COPY t TO '{tmp_path / 'src.parquet'}' (FORMAT parquet)")
    con.execute(f"COPY t TO '{tmp_path / 'src.jsonl'}' (FORMAT json)")
    con.close()
    sources = [{"parquet": str(tmp_path / "src.parquet")}, {"jsonl": str(tmp_path / "src.jsonl")},
               {"query": "SELECT * FROM t WHERE id <= 4", "database": str(tmp_path / "src.duckdb")},
               {"table": "t", "database": str(tmp_path / "src.duckdb"), "limit": 2},
               {"query": f"SELECT * FROM read_csv_auto('{data}');"}]
    expected = [N, N, 4, 2, N]
    for source, rows in zip(sources, expected):
        result = run_pipeline(_pipeline(tmp_path, data, source=source), engine=FakeLLM())
        assert result.rows_written == rows, source


def test_job_errors_name_what_is_wrong(tmp_path, data):
    with pytest.raises(SourceError, match="file not found"):
        run_pipeline(_pipeline(tmp_path, data, source={"csv": str(tmp_path / "missing.csv")}), engine=FakeLLM())
    with pytest.raises(TemplateError, match=r"steps\[0\] \(llm_map\).*'nope'.*available columns: id, subject"):
        run_pipeline(_pipeline(tmp_path, data, steps=[{"llm_map": {"output": "o", "template": "{nope}"}}]),
                     engine=FakeLLM())
    with pytest.raises(StepError, match=r"steps\[0\] \(filter\).*zz"):
        run_pipeline(_pipeline(tmp_path, data, steps=[{"filter": "zz > 1"}]), engine=FakeLLM())
    with pytest.raises(TemplateError, match="nope"):
        plan_pipeline(_pipeline(tmp_path, data, steps=[{"llm_map": {"output": "o", "template": "{nope}"}}]))


SAMPLE_PIPELINES = sorted((REPO / "pipelines").glob("*.yaml"))


@pytest.mark.parametrize("path", SAMPLE_PIPELINES, ids=[p.stem for p in SAMPLE_PIPELINES])
def test_sample_pipelines_dry_run(path, monkeypatch):
    monkeypatch.chdir(REPO)
    plan = plan_pipeline(load_pipeline(path), limit=3)
    assert plan["steps"] and all(s["rows_in_sample"] == 3 for s in plan["steps"])


@requires_smollm2
@pytest.mark.slow
@pytest.mark.parametrize("path", SAMPLE_PIPELINES, ids=[p.stem for p in SAMPLE_PIPELINES])
def test_sample_pipelines_run_on_the_embedded_model(path, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    pipeline = load_pipeline(path, overrides=[f"cache_dir={tmp_path / 'cache'}",
                                              f"sink.{load_pipeline(path).sink.kind}={tmp_path / 'out'}"])
    result = run_pipeline(pipeline, limit=3, use_cache=False)
    assert result.rows_written == 3 and result.generated_tokens > 0
    out = (pq.read_table(tmp_path / "out") if pipeline.sink.kind == "parquet" else
           duckdb.sql(f"SELECT * FROM read_csv_auto('{tmp_path / 'out'}')").to_arrow_table())
    assert out.num_rows == 3 and out["id"].to_pylist() == [1, 2, 3]
    if all(step.choices for step in pipeline.llm_steps):
        assert result.failed_rows == 0  # a choice is always complete within max_new_tokens


def test_every_run_writes_a_report_beside_the_sink(tmp_path):
    """`<sink>.report.json`: figures, failures by reason, timeline, time split, plan vs measured."""
    result, report = fake_engine_report(tmp_path)
    path = tmp_path / "out.parquet.report.json"
    assert result.report == str(path) and "report:" in str(result)
    assert report["run"]["rows_written"] == 4
    assert set(report["time"]) >= {"source", "sink", "other", "load", "plan", "prefill", "decode", "grammar_mask",
                                   "cache"}
    step = report["llm_steps"][0]
    assert step["failures"] == {"cut by max_new_tokens": 1}
    assert step["timeline"][-1][1] == 4 and sum(step["throughput"]["rows"]) == 4
    assert sum(report["time"].values()) == pytest.approx(report["run"]["seconds"], rel=1e-6, abs=1e-6)
    assert step["engine"] is None and step["comparison"]["predicted_tokens_per_s"] is None   # fake: no stats
