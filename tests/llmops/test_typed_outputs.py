"""Typed outputs of the adapters on the fake engine: choices as `pl.Enum` / DuckDB `ENUM`, and default
output names of unaliased `llm_map` expressions that do not collide."""
from __future__ import annotations

import duckdb
import polars as pl
import pytest

from helpers.fake_engine import FakeLLM
from llmops.duckdb import map_relation, register
from llmops.polars import llm_map

LABELS = ["bug", "billing", "other"]


@pytest.fixture
def df() -> pl.DataFrame:
    return pl.DataFrame({"body": ["a bug", "billing q", None], "subject": ["x", "y", "z"]})


def test_polars_choices_are_an_enum(df):
    eng = FakeLLM()
    out = df.with_columns(llm_map("{body}", choices=LABELS, engine=eng, cache_dir=False).alias("label"))
    assert out.schema["label"] == pl.Enum(LABELS) and out["label"].to_list() == ["bug", "billing", None]
    meta = df.select(llm_map("{body}", choices=LABELS, engine=eng, cache_dir=False, with_meta=True).alias("m"))
    assert meta.schema["m"].to_schema()["output"] == pl.Enum(LABELS)
    lazy = df.lazy().select(llm_map("{body}", choices=LABELS, engine=eng, cache_dir=False).alias("label"))
    assert lazy.collect_schema()["label"] == pl.Enum(LABELS)


def test_unaliased_maps_get_distinct_names(df):
    eng = FakeLLM()
    a = llm_map("Label {body}", choices=LABELS, engine=eng, cache_dir=False)
    b = llm_map("Summarise {body}", engine=eng, cache_dir=False)
    out = df.with_columns(a, b)
    names = [c for c in out.columns if c.startswith("llm_map_body_")]
    assert len(names) == 2 and len(set(names)) == 2
    again = llm_map("Label {body}", choices=LABELS, engine=eng, cache_dir=False)
    assert df.select(again).columns[0] == df.select(a).columns[0]      # the same spec, the same name


def test_duckdb_choices_are_an_enum():
    con = duckdb.connect()
    con.execute("CREATE TABLE t AS SELECT * FROM (VALUES ('a bug'), ('billing q'), (NULL)) v(body)")
    eng = FakeLLM()
    register(con, name="label", template="{body}", choices=LABELS, engine=eng, cache_dir=False)
    rel = con.sql("SELECT label(body) AS l FROM t")
    assert str(rel.types[0]) == "ENUM('bug', 'billing', 'other')" and rel.fetchall() == [("bug",), ("billing",), (None,)]
    register(con, choices=LABELS, engine=eng, cache_dir=False)
    assert str(con.sql("SELECT llm_map('{body}', body) FROM t").types[0]).startswith("ENUM(")
    out = map_relation(con, "SELECT * FROM t", "{body}", choices=LABELS, engine=eng, cache_dir=False, output="l")
    assert str(out.types[out.columns.index("l")]) == "ENUM('bug', 'billing', 'other')"
    assert [r[0] for r in out.select("l").fetchall()] == ["bug", "billing", None]
