"""The semantic operators on the fake engine: filter, reduce (folding), resolve, join, validate (retries),
their Polars and DuckDB spellings, and that every LLM stage is one batched engine call."""
from __future__ import annotations

import duckdb
import polars as pl
import pyarrow as pa
import pytest

import llmops
import llmops.semantic.polars
from helpers.fake_engine import FakeLLM
from llmops.semantic import Blocking, Llm, llm_filter_table, llm_join_table, llm_reduce_table, resolve_table
from llmops.semantic import duckdb as sem_duckdb
from llmops.semantic.reduce import pack
from llmops.core import MapSpec
from llmops.templates import TemplateError
from llmops.validate import RETRY_SUFFIX, RuleError, failed_rules, run_checked


def _llm(engine: FakeLLM, **kw) -> Llm:
    return Llm.of(engine=engine, cache_dir=False, progress=False, **kw)


TICKETS = pa.table({"id": [1, 2, 3, 4], "body": ["a Yes bug", "No thanks", "Yes again", None]})


def test_llm_filter_keeps_yes_rows_in_one_call():
    engine = FakeLLM()
    out = llm_filter_table(TICKETS, "Is it a bug? {body}", _llm(engine))
    assert out.column("id").to_pylist() == [1, 3]          # the fake answers the choice named in the row
    assert engine.calls == 1 and engine.last_params.choices == ("Yes", "No")


def test_llm_filter_reason_column():
    out = llm_filter_table(TICKETS, "Is it a bug? {body}", _llm(FakeLLM()), reason_column="why")
    assert "why" in out.column_names and all(isinstance(r, str) for r in out.column("why").to_pylist())


def test_polars_llm_filter_expression_and_frame():
    df = pl.from_arrow(TICKETS)
    engine = FakeLLM()
    kept = df.filter(llmops.llm_filter("Is it a bug? {body}", engine=engine, cache_dir=False))
    assert kept["id"].to_list() == [1, 3]
    framed = llmops.semantic.polars.filter_frame(df, "Is it a bug? {body}", engine=engine, cache_dir=False)
    assert framed["id"].to_list() == [1, 3]


def test_duckdb_register_filter_macro():
    con = duckdb.connect()
    con.register("t", TICKETS)
    sem_duckdb.register_filter(con, "is_bug", "Is it a bug? {body}", engine=FakeLLM(), cache_dir=False)
    assert [r[0] for r in con.sql("SELECT id FROM t WHERE is_bug(body) ORDER BY id").fetchall()] == [1, 3]


@pytest.mark.parametrize("sizes, budget, chunks", [
    ([], 10, []), ([3, 3, 3], 10, [[0, 1, 2]]), ([4, 4, 4], 8, [[0, 1], [2]]), ([20, 1, 1], 8, [[0], [1, 2]]),
])
def test_pack(sizes, budget, chunks):
    assert pack(sizes, budget) == chunks


GROUPS = pa.table({"cat": ["a", "b", "a", "a", "b", "a"], "body": [f"ticket number {i}" for i in range(6)]})


def test_llm_reduce_one_call_per_group_when_it_fits():
    engine = FakeLLM()
    out, report = llm_reduce_table(GROUPS, ["cat"], "Summarise {cat}:\n{rows}", _llm(engine))
    assert out.column("cat").to_pylist() == ["a", "b"] and report.levels == [2] and engine.calls == 1
    assert out.column("output")[0].as_py() == "echo: Summarise a:\n- ticket number 0\n- ticket number 2\n" \
                                             "- ticket number 3\n- ticket number 5"


def test_llm_reduce_folds_groups_that_do_not_fit():
    engine = FakeLLM()
    out, report = llm_reduce_table(GROUPS, ["cat"], "S:\n{rows}", _llm(engine), max_prompt_tokens=40,
                                   fold_template="F:\n{rows}", max_new_tokens=3)
    assert report.levels[0] > 2 and report.levels[-1] == 2 and len(report.levels) >= 2
    assert engine.calls == len(report.levels)                       # one engine call per level, all groups in it
    first, second = out.column("output").to_pylist()
    assert first.startswith("echo: F:") and second.startswith("echo: S:")   # group b fits at level 0


def test_llm_reduce_errors_name_the_problem():
    with pytest.raises(TemplateError, match="must contain"):
        llm_reduce_table(GROUPS, ["cat"], "no rows here {cat}", _llm(FakeLLM()))
    with pytest.raises(ValueError, match="llm_reduce.by.*'nope'"):
        llm_reduce_table(GROUPS, ["nope"], "{rows}", _llm(FakeLLM()))
    with pytest.raises(TemplateError, match="'body'"):
        llm_reduce_table(GROUPS, ["cat"], "{rows} {body}", _llm(FakeLLM()))


PEOPLE = pa.table({"id": [10, 11, 12, 13, 14], "name": ["Noah O'Brien", "O'BRIEN, Noah", "Isla Johnson",
                                                         "isla johnson", "Zed Quux"],
                   "phone": ["1", None, "2", None, "1"]})


def test_resolve_blocks_compares_and_clusters():
    engine = FakeLLM()
    out, report = resolve_table(PEOPLE, ["name"], _llm(engine), blocking=Blocking(keys=("phone",), threshold=0.5),
                                id_column="id")
    # the fake answers "Same" (the first choice the prompt names) for every compared pair
    assert out.column("entity_id").to_pylist() == [10, 10, 12, 12, 10]
    assert report.all_pairs == 10 and report.compared_pairs == 3 and report.entities == 2
    assert engine.calls == 1 and engine.prompts_seen == 3


def test_resolve_uses_the_model_decision():
    template = "{left_name} vs {right_name}"     # names neither choice: the fake picks by hash
    engine = FakeLLM()
    out, report = resolve_table(PEOPLE, ["name"], _llm(engine), blocking=Blocking(threshold=0.5), template=template)
    spec = MapSpec(template=template, choices=("Same", "Different"))
    assert report.matched_pairs <= report.compared_pairs == 2
    assert set(out.column("entity_id").to_pylist()) <= {0, 1, 2, 3, 4} and spec.choices


def test_resolve_errors_name_the_column():
    with pytest.raises(ValueError, match=r"resolve.on: unknown column\(s\) \['nme'\]"):
        resolve_table(PEOPLE, ["nme"], _llm(FakeLLM()))


def test_llm_join_matches_with_order_swap_confidence():
    left = pa.table({"id": [1, 2], "title": ["Sony WH-1000XM5 Black", "Apple iPhone 14 128GB"]})
    right = pa.table({"id": [7, 8, 9], "title": ["iPhone 14 128GB by Apple", "WH-1000XM5 black, Sony", "Bose QC"]})
    engine = FakeLLM()
    out, report = llm_join_table(left, right, _llm(engine), left_on=["title"], blocking=Blocking(threshold=0.4))
    assert sorted(zip(out.column("id").to_pylist(), out.column("id_right").to_pylist())) == [(1, 8), (2, 7)]
    assert out.column("confidence").to_pylist() == [1.0, 1.0] and report.prompts == 4 and engine.calls == 1
    df = llmops.llm_join(pl.from_arrow(left), pl.from_arrow(right), on="title", engine=engine, cache_dir=False,
                         blocking={"threshold": 0.4})
    assert df.columns[-2:] == ["similarity", "confidence"] and df.height == 2


def test_validate_retries_failing_rows_with_feedback_then_keeps_error_rows():
    table = pa.table({"body": ["ok one", "bad two", "ok three"]})
    engine = FakeLLM()
    spec = MapSpec(template="Say: {body}", max_new_tokens=8)
    res = run_checked(table, spec, rules=["output NOT LIKE '%bad%'"], max_attempts=3, cache_dir=False, engine=engine)
    assert res.table.column("attempts").to_pylist() == [1, 3, 1]
    assert res.retried == 2 and res.rejected == 1 and engine.calls == 3
    assert res.table.column("output").to_pylist()[1] is None
    assert "fails validate rule \"output NOT LIKE '%bad%'\" after 3 attempt(s)" in res.table.column("error")[1].as_py()
    retry_prompts = [p for p in engine.seen if "was rejected" in p]
    assert retry_prompts and all('"data": "it must satisfy' in p for p in retry_prompts)   # feedback is data
    assert RETRY_SUFFIX.startswith("\n\n")


def test_validate_rows_that_pass_after_a_retry():
    table = pa.table({"body": ["x"]})
    res = run_checked(table, MapSpec(template="{body}", max_new_tokens=8), rules=["output LIKE '%rejected%'"],
                      cache_dir=False, engine=FakeLLM())
    assert res.table.column("attempts").to_pylist() == [2] and res.rejected == 0   # the echo holds the feedback


def test_validate_rule_errors_name_rule_and_columns():
    with pytest.raises(RuleError, match="(?s)nope.*columns: body, output"):
        failed_rules(pa.table({"body": ["a"], "output": ["b"]}), ["nope > 1"])


def test_validate_on_operators_struct_output():
    out, _ = llm_reduce_table(GROUPS, ["cat"], "{rows}", _llm(FakeLLM(), validate="output.n >= 0"),
                              schema={"n": "integer"})
    assert all(isinstance(v["n"], int) for v in out.column("output").to_pylist())


def test_no_kept_rows_and_no_valued_outputs_keep_the_schema():
    out = llm_filter_table(pa.table({"body": ["No"]}), "Q {body}", _llm(FakeLLM()))
    assert out.num_rows == 0 and out.column_names == ["body"]
    res = run_checked(pa.table({"body": [None]}), MapSpec(template="{body}"), rules=["output IS NOT NULL"],
                      cache_dir=False, engine=FakeLLM())
    assert res.table.column("output").to_pylist() == [None] and res.retried == 0
