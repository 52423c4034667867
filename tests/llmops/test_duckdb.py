"""DuckDB: llm_map scalar/struct, typed STRUCT functions, map_relation, NULLs, errors, chunked calls."""
from __future__ import annotations

import duckdb
import pytest

from helpers.fake_engine import FakeLLM
from llmops.duckdb import duckdb_type, map_relation, register
from llmops.core import last_summary


@pytest.fixture
def con():
    con = duckdb.connect()
    con.execute("CREATE TABLE t AS SELECT * FROM (VALUES ('Paris rue', 1), (NULL, 2), ('Oslo gate', 3), "
                "('Paris rue', 4)) v(addr, id)")
    return con


def test_scalar_llm_map_and_nulls(con):
    eng = FakeLLM()
    register(con, engine=eng, cache_dir=False)
    rows = con.execute("SELECT id, llm_map('City of {address}', addr) FROM t ORDER BY id").fetchall()
    assert rows == [(1, "echo: City of Paris rue"), (2, None), (3, "echo: City of Oslo gate"),
                    (4, "echo: City of Paris rue")]
    assert eng.prompts_seen == 2
    assert con.execute("SELECT llm_map('n={v}', 42)").fetchone() == ("echo: n=42",)
    assert con.execute("SELECT llm_map('x {v}', NULL)").fetchone() == (None,)


def test_struct_argument_names_placeholders(con):
    eng = FakeLLM()
    register(con, engine=eng, cache_dir=False)
    rows = con.execute("SELECT llm_map('{a} #{b}', {'a': addr, 'b': id}) FROM t ORDER BY id").fetchall()
    assert rows == [("echo: Paris rue #1",), (None,), ("echo: Oslo gate #3",), ("echo: Paris rue #4",)]


def test_typed_function_returns_struct(con):
    eng = FakeLLM()
    register(con, name="extract_city", template="Extract from {addr} ({id})",
             schema={"city": str, "zip": int}, engine=eng, cache_dir=False)
    kind = con.execute("DESCRIBE SELECT extract_city(addr, id) AS e FROM t").fetchall()[0][1]
    assert kind == "STRUCT(city VARCHAR, zip BIGINT)"
    rows = con.execute("SELECT id, extract_city(addr, id) FROM t ORDER BY id").fetchall()
    assert rows[1] == (2, None)
    assert set(rows[0][1]) == {"city", "zip"} and isinstance(rows[0][1]["zip"], int)
    assert con.execute("SELECT extract_city(addr, id).city FROM t WHERE id = 3").fetchone()[0].startswith("city-")


def test_errors_are_pinned(con):
    register(con, engine=FakeLLM(), cache_dir=False)
    with pytest.raises(duckdb.InvalidInputException, match=r"has 2 placeholders \['a', 'b'\]; pass a struct"):
        con.execute("SELECT llm_map('{a} {b}', addr) FROM t").fetchall()
    with pytest.raises(duckdb.InvalidInputException, match=r"uses \['c'\] which the struct does not have; "
                                                            r"available fields: a, b"):
        con.execute("SELECT llm_map('{a} {c}', {'a': addr, 'b': id}) FROM t").fetchall()
    with pytest.raises(ValueError, match="plain SQL identifier"):
        register(con, name="drop table")


def test_map_relation_whole_query(con):
    eng = FakeLLM()
    rel = map_relation(con, "SELECT * FROM t ORDER BY id", "City of {addr}", output="city", with_meta=True,
                       engine=eng, cache_dir=False)
    assert rel.columns == ["addr", "id", "city", "finish_reason", "error", "text", "prompt_tokens",
                           "completion_tokens", "confidence", "model"]
    rows = rel.fetchall()
    assert [r[2] for r in rows] == ["echo: City of Paris rue", None, "echo: City of Oslo gate",
                                    "echo: City of Paris rue"]
    assert eng.calls == 1 and eng.prompts_seen == 2


def test_large_table_is_called_per_chunk_and_each_prompt_generated_once(con, tmp_path):
    con.execute("CREATE TABLE big AS SELECT range AS i, 'row ' || (range % 7000) AS s FROM range(10000)")
    eng = FakeLLM(block_size=512)
    register(con, engine=eng, cache_dir=False, max_new_tokens=3)
    assert con.execute("SELECT count(*), count(llm_map('{s}', s)) FROM big").fetchall() == [(10000, 10000)]
    assert eng.calls == 4                 # 2048-row chunks; the last one's prompts were all generated before
    assert eng.prompts_seen == 7000 and set(eng.seen.values()) == {1}     # one job: each prompt once
    assert (last_summary().rows, last_summary().calls) == (10000, 5)      # the summary covers the query
    cached = FakeLLM(block_size=512)
    register(con, engine=cached, cache_dir=tmp_path, max_new_tokens=3)
    assert con.execute("SELECT count(llm_map('{s}', s)) FROM big").fetchone() == (10000,)
    assert cached.prompts_seen == 7000 and set(cached.seen.values()) == {1}   # repeats across chunks: cache


def test_side_effects_flag_when_sampling(con):
    eng = FakeLLM()
    register(con, engine=eng, cache_dir=False, temperature=0.7, seed=3)
    assert con.execute("SELECT llm_map('x {v}', 'y')").fetchone() == ("echo: x y",)
    assert eng.last_params.temperature == 0.7 and eng.last_params.seed == 3


def test_duckdb_type_strings():
    import pyarrow as pa
    assert duckdb_type(pa.struct([("a b", pa.list_(pa.int64())), ("c", pa.bool_())])) == \
        'STRUCT("a b" BIGINT[], "c" BOOLEAN)'
