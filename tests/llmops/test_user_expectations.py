"""What users of LOTUS, DocETL and simonw/llm expect of the semantic operators and of `llm_map`, on the fake
engine: resolve's entities are right on the sample customers, a Different answer is never overridden by a
chain of Same answers, DuckDB's `llm_join(on="title")` takes one column name, asking a filter for its reason
does not change what it keeps, `last_summary()` covers every expression of one Polars query, and `llm_map`
and DuckDB functions take `validate` rules."""
from __future__ import annotations

import csv

import duckdb
import polars as pl
import pyarrow as pa

import llmops
import llmops.duckdb
import llmops.semantic.polars
from helpers.fake_engine import FakeLLM
from helpers.paths import REPO
from engine.decoding.params import Completion
from llmops.core import MapSpec, map_table_ordered
from llmops.pipeline.load import load_pipeline
from llmops.pipeline.runner import run_pipeline
from llmops.semantic import Llm, resolve_table
from llmops.semantic import duckdb as sem_duckdb
from llmops.semantic.blocking import Blocking, blocking_text
from llmops.semantic.components import clusters, components, pair_scores

RESOLVE_YAML = REPO / "pipelines" / "semantic" / "resolve_customers.yaml"


def test_resolve_sample_pipeline_finds_the_people_on_60_rows(tmp_path):
    """The fake engine says Same to every pair (as a 135M model nearly does): the entities rest on blocking,
    which must not make every pair of a small table look alike through the column names."""
    out = tmp_path / "resolved.parquet"
    pipeline = load_pipeline(RESOLVE_YAML, overrides=["cache_dir=false", f"sink.parquet={out}"])
    result = run_pipeline(pipeline, limit=60, engine=FakeLLM(), progress=False)
    got = pl.read_parquet(out)
    with open(REPO / "sample_data" / "customers_dupes.csv", encoding="utf-8") as f:
        gold = {int(r["id"]): r["label_entity"] for r in csv.DictReader(f)}
    scores = pair_scores(got["entity_id"].to_list(), [gold[int(i)] for i in got["id"].to_list()])
    assert result.rows_written == 60 and scores["precision"] >= 0.9 and scores["recall"] >= 0.9
    assert got["entity_id"].n_unique() >= 40                     # 48 people among the first 60 records


def test_blocking_compares_values_not_column_names():
    assert blocking_text({"name": "Ann Lee", "city": None, "phone": "1"}, ["name", "city"]) == "Ann Lee"
    people = pa.table({"name": ["Ann Lee", "Bob Stone"], "city": ["Leeds", "Austin"]})
    _, report = resolve_table(people, ["name", "city"], Llm.of(engine=FakeLLM(), cache_dir=False, progress=False))
    assert report.candidate_pairs == 0 and report.entities == 2


class PairJudge(FakeLLM):
    """Answers Same or Different per pair of records from `answers` {frozenset of two names: answer}."""

    def __init__(self, answers: dict[frozenset, str]) -> None:
        super().__init__()
        self.answers = answers

    def complete(self, prompt, params):
        text = prompt if isinstance(prompt, str) else str(prompt)
        names = frozenset(n for pair in self.answers for n in pair if n in text)
        return Completion(self.answers.get(names, "Different"), [1], "stop", len(text))


def test_a_chain_of_same_answers_never_joins_a_different_pair():
    """a ~ b and b ~ c said Same, a vs c said Different: connected components would make one entity."""
    names = ["Ann Lee Leeds", "Ann Lees Leeds", "Anne Lees Leeds"]
    judge = PairJudge({frozenset(names[:2]): "Same", frozenset(names[1:]): "Same",
                       frozenset([names[0], names[2]]): "Different"})
    table = pa.table({"name": names})
    out, report = resolve_table(table, ["name"], Llm.of(engine=judge, cache_dir=False, progress=False),
                                blocking=Blocking(threshold=0.3))
    labels = out.column("entity_id").to_pylist()
    assert report.compared_pairs == 3 and report.matched_pairs == 2 and report.cut_pairs == 1
    assert labels[0] != labels[2] and len(set(labels)) == 2


def test_clusters_merge_best_first_and_keep_different_pairs_apart():
    assert clusters(4, [(0, 1), (1, 2), (2, 3)]) == components(4, [(0, 1), (1, 2), (2, 3)]) == [0, 0, 0, 0]
    assert clusters(4, [(0, 1), (1, 2), (2, 3)], [(0, 3)]) == [0, 0, 0, 3]
    assert clusters(4, [(2, 3), (1, 2), (0, 1)], [(0, 3)]) == [0, 1, 1, 1]  # the order given decides
    assert clusters(3, [(1, 2)], [(1, 2)]) == [0, 1, 2]


def test_duckdb_llm_join_takes_one_column_name():
    con = duckdb.connect()
    con.register("a", pa.table({"title": ["Sony WH-1000XM5 Black", "Apple iPhone 14"]}))
    con.register("b", pa.table({"title": ["WH-1000XM5 black Sony", "iPhone 14 Apple", "Bose QC45"]}))
    rel = sem_duckdb.llm_join(con, "SELECT * FROM a", "SELECT * FROM b", on="title", engine=FakeLLM(),
                              cache_dir=False, progress=False)
    assert {"title", "title_right", "confidence"} <= set(rel.columns)
    kept = sem_duckdb.resolve(con, "SELECT * FROM a", on="title", engine=FakeLLM(), cache_dir=False, progress=False)
    assert kept.columns[-1] == "entity_id"


def test_a_filter_keeps_the_same_rows_with_or_without_its_reason():
    df = pl.DataFrame({"id": list(range(12)), "body": [f"ticket {i}: {'Yes' if i % 2 else 'No'}" for i in range(12)]})
    engine = FakeLLM()
    plain = llmops.semantic.polars.filter_frame(df, "Keep? {body}", engine=engine, cache_dir=False, progress=False)
    why = llmops.semantic.polars.filter_frame(df, "Keep? {body}", reason="why", engine=engine, cache_dir=False,
                                              progress=False)
    assert plain["id"].to_list() == why["id"].to_list() == [1, 3, 5, 7, 9, 11]
    assert why["why"].null_count() == 0 and all("Answer: Yes" in r for r in why["why"].to_list())


def test_last_summary_covers_every_expression_of_a_query():
    n = 6
    df = pl.DataFrame({"body": [f"row {i}" for i in range(n)]})
    engine = FakeLLM()
    df.with_columns(llmops.llm_map("A {body}", engine=engine, cache_dir=False).alias("a"),
                    llmops.llm_map("B {body}", engine=engine, cache_dir=False).alias("b"))
    summary, per_job = llmops.last_summary(), llmops.last_summaries()
    assert (summary.rows, summary.generated_rows, summary.calls) == (2 * n, 2 * n, 2)
    assert [s.rows for s in per_job] == [n, n]
    table = pa.table({"body": ["x", "y", "z"]})
    map_table_ordered(table, MapSpec("one {body}"), engine=engine, cache_dir=False)
    map_table_ordered(table.slice(0, 2), MapSpec("two {body}"), engine=engine, cache_dir=False)
    assert llmops.last_summary().rows == 2 and len(llmops.last_summaries()) == 1   # two runs, two queries


def test_polars_llm_map_validates_and_retries():
    df = pl.DataFrame({"body": ["a printer", "a laptop", "a bug in the app", "the sky"]})
    engine = FakeLLM()
    out = df.with_columns(llmops.llm_map("Kind of {body}", choices=["bug", "other"], validate="output = 'bug'",
                                         engine=engine, cache_dir=False, with_meta=True).alias("m")).unnest("m")
    assert out["output"].to_list() == ["bug"] * 4            # the retry names the rule, so the fake answers bug
    assert engine.prompts_seen > 4 and out["error"].null_count() == 4
    once = df.with_columns(llmops.llm_map("Kind of {body}", choices=["bug", "other"], validate="output = 'bug'",
                                          max_attempts=1, engine=FakeLLM(), cache_dir=False, with_meta=True)
                           .alias("m")).unnest("m")
    failed = [e for e in once["error"].to_list() if e is not None]
    assert failed and all("fails validate rule" in e for e in failed) and once["output"].null_count() == len(failed)


def test_duckdb_function_validates_and_retries():
    con = duckdb.connect()
    con.register("t", pa.table({"body": ["a printer", "a laptop", "a bug in the app"]}))
    llmops.duckdb.register(con, name="kind", template="Kind of {body}", choices=["bug", "other"],
                           validate="output = 'bug'", engine=FakeLLM(), cache_dir=False)
    assert [r[0] for r in con.sql("SELECT kind(body) FROM t").fetchall()] == ["bug"] * 3
