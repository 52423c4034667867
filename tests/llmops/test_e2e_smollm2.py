"""End to end on the embedded SmolLM2-135M-Instruct: Polars (eager/lazy/streaming), DuckDB (scalar,
struct, relation) and a few-shot schema extraction whose every finished output parses."""
from __future__ import annotations

import duckdb
import polars as pl
import pytest

import llmops
from helpers.skips import requires_smollm2
from llmops.duckdb import map_relation, register

pytestmark = [requires_smollm2, pytest.mark.slow]

ROWS = ["10 Downing Street, London SW1A 2AA", "Unter den Linden 77, 10117 Berlin", None,
        "350 Fifth Avenue, New York, NY 10118"]
EXAMPLES = [{"input": {"address": "Damrak 1, 1012 LG Amsterdam"}, "output": {"city": "Amsterdam"}},
            {"input": {"address": "233 S Wacker Dr, Chicago, IL 60606"}, "output": {"city": "Chicago"}}]


@pytest.mark.parametrize("mode", ["eager", "lazy", "streaming"])
def test_polars_modes(tmp_path, mode):
    df = pl.DataFrame({"address": ROWS})
    expr = llmops.llm_map("Is this address in Europe? {address}", choices=["yes", "no"],
                          cache_dir=tmp_path / mode, progress=False).alias("eu")
    out = df.with_columns(expr) if mode == "eager" else df.lazy().with_columns(expr).collect(
        engine="streaming" if mode == "streaming" else "in-memory")
    values = out["eu"].to_list()
    assert values[2] is None and all(v in ("yes", "no") for i, v in enumerate(values) if i != 2)
    assert llmops.last_summary().nulls == 1


def test_schema_extraction_every_finished_output_parses(tmp_path):
    df = pl.DataFrame({"address": ROWS})
    out = df.with_columns(llmops.llm_map(
        "Extract the city from this address: {address}", schema={"city": pl.String}, examples=EXAMPLES,
        max_new_tokens=24, cache_dir=tmp_path, with_meta=True).alias("r")).unnest("r")
    for output, reason in zip(out["output"].to_list(), out["finish_reason"].to_list()):
        if reason == "stop":
            assert isinstance(output["city"], str) and output["city"]
    assert out["finish_reason"].to_list().count("stop") >= 2
    assert out["output"][2] is None


def test_duckdb_scalar_struct_relation(tmp_path):
    con = duckdb.connect()
    con.execute("CREATE TABLE t (id INTEGER, address VARCHAR)")
    con.executemany("INSERT INTO t VALUES (?, ?)", [(i, a) for i, a in enumerate(ROWS)])
    register(con, cache_dir=tmp_path, max_new_tokens=6)
    scalar = con.execute("SELECT id, llm_map('Name the city: {a}', address) FROM t ORDER BY id").fetchall()
    assert scalar[2] == (2, None) and all(isinstance(v, str) for i, v in scalar if i != 2)
    struct = con.execute("SELECT llm_map('Address #{id}: {a}. City?', {'id': id, 'a': address}) FROM t "
                         "ORDER BY id").fetchall()
    assert struct[2] == (None,) and isinstance(struct[0][0], str)
    register(con, name="city_of", template="Extract the city from this address: {address}",
             schema={"city": str}, examples=EXAMPLES, max_new_tokens=24, cache_dir=tmp_path)
    typed = con.execute("SELECT city_of(address) FROM t ORDER BY id").fetchall()
    assert typed[2] == (None,) and sum(isinstance(r[0], dict) for r in typed) >= 2
    rel = map_relation(con, "SELECT * FROM t ORDER BY id", "Name the city: {address}", output="c",
                       max_new_tokens=6, cache_dir=tmp_path)
    rows = rel.fetchall()
    assert [r[2] for r in rows] == [r[1] for r in scalar]   # same prompts, params: served from the cache
