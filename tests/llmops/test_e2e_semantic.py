"""The semantic operators end to end on the embedded SmolLM2-135M-Instruct, a few rows each: the outputs
are well formed (a 135M model's accuracy is measured in benchmarks/accuracy/semantic_accuracy.py, not asserted).
The tests share one loaded model: every call here asks for the same default engine, which `llmops.engines`
builds once per process (test_e2e_smollm2.py's calls share it too)."""
from __future__ import annotations

import duckdb
import polars as pl
import pytest

import llmops
import llmops.semantic.polars  # noqa: F401 (llmops.llm_filter and friends)
from helpers.skips import requires_smollm2
from llmops.semantic import duckdb as sem_duckdb

pytestmark = [requires_smollm2, pytest.mark.slow]

TICKETS = pl.DataFrame({"id": [1, 2, 3, 4], "cat": ["a", "a", "a", "b"],
                        "body": ["The export button crashes the app.", "I was charged twice this month.",
                                 "Login fails with error 500.", "Where is the user guide?"]})


def test_llm_filter_expression_and_reason(tmp_path):
    kept = TICKETS.filter(llmops.llm_filter("Is this ticket a bug report? {body}", cache_dir=tmp_path, progress=False))
    assert set(kept["id"].to_list()) <= {1, 2, 3, 4}
    why = llmops.semantic.polars.filter_frame(TICKETS, "Is this a bug report? {body}", reason="why",
                                              cache_dir=tmp_path, progress=False, max_new_tokens=16)
    assert why.columns[-1] == "why" and why["why"].null_count() == 0   # every kept row's JSON closed


def test_llm_reduce_folds_on_the_real_tokenizer(tmp_path):
    out, report = llmops.llm_reduce(TICKETS, "cat", "Tickets:\n{rows}\nOne word for their topic:", item="- {body}",
                                    max_prompt_tokens=60, max_new_tokens=4, cache_dir=tmp_path, progress=False,
                                    with_report=True)
    assert out["cat"].to_list() == ["a", "b"] and len(report.levels) == 2 and report.levels[-1] == 1
    assert out["output"].null_count() == 0


def test_resolve_and_duckdb_relation(tmp_path):
    df = pl.DataFrame({"id": [1, 2, 3], "name": ["Noah O'Brien", "O'BRIEN, Noah", "Isla Johnson"],
                       "city": ["Boston", "boston", "Leeds"]})
    out, report = llmops.resolve(df, on=["name", "city"], id_column="id", cache_dir=tmp_path, progress=False,
                                 with_report=True)
    assert report.compared_pairs == 1 and report.all_pairs == 3 and out["entity_id"][2] == 3
    con = duckdb.connect()
    con.register("people", df.to_arrow())
    rel = sem_duckdb.resolve(con, "SELECT * FROM people", on=["name", "city"], cache_dir=tmp_path, progress=False)
    assert rel.columns[-1] == "entity_id" and len(rel.fetchall()) == 3


def test_llm_join_pairs_with_confidence(tmp_path):
    left = pl.DataFrame({"title": ["Sony WH-1000XM5 Black", "Apple iPhone 14 128 GB Blue"]})
    right = pl.DataFrame({"title": ["WH-1000XM5 (Wireless) - Black, Sony", "iPhone 14 128GB Blue by Apple", "Bose QC45"]})
    out, report = llmops.llm_join(left, right, on="title", cache_dir=tmp_path, progress=False, with_report=True,
                                  blocking={"threshold": 0.3, "top_k": 1})
    assert report.prompts == 2 * report.candidate_pairs and set(out["confidence"].to_list()) <= {0.5, 1.0}
