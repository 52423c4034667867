"""Hostile parameter values and cell values on the Python, Polars, DuckDB and CLI paths: a clear error naming the
field (before any generation), or the value rendered as what it is; never a crash deep inside, a silently changed
value ("yes" as the choices y, e, s; a null as "None") or a row number that no longer matches its line."""
from __future__ import annotations

import json
import math

import duckdb
import polars as pl
import pyarrow as pa
import pytest
from click.testing import CliRunner

import llmops
from engine.decoding.params import SamplingParams
from helpers.fake_engine import FakeLLM
from llmops.cli import main
from llmops.core import MapSpec, map_table_ordered
from llmops.duckdb import register
from llmops.semantic import Llm, llm_reduce_table, resolve_table

NAN, INF = float("nan"), float("inf")

BAD_PARAMS = [  # (keyword arguments, what the error says)
    ({"temperature": NAN}, "temperature must be a finite number, got nan"),
    ({"temperature": INF}, "temperature must be a finite number, got inf"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"top_p": NAN}, "top_p must be a finite number"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": -2}, "top_k must be >= 0"),
    ({"seed": 1.5}, "seed must be an integer, got 1.5"),
    ({"max_new_tokens": INF}, "max_new_tokens must be a finite number"),
    ({"max_new_tokens": "8"}, "max_new_tokens must be a number, got '8'"),
    ({"choices": "yes"}, "choices must be a list of strings, got str 'yes'"),
    ({"choices": [1, None]}, "choices[0] must be a string, got int 1"),
    ({"choices": ["a", None]}, "choices[1] must be a string, got NoneType None"),
    ({"choices": ["a", "a"]}, "choices[1] 'a' is given twice"),
    ({"choices": ["a", ""]}, "choices[1] must not be empty"),
    ({"choices": []}, "choices must not be empty"),
]


@pytest.mark.parametrize("kwargs, message", BAD_PARAMS, ids=[str(b[0]) for b in BAD_PARAMS])
def test_bad_parameters_fail_on_every_path_before_any_work(kwargs, message):
    eng = FakeLLM()
    with pytest.raises(ValueError) as engine_error:
        SamplingParams(**kwargs)
    assert message in str(engine_error.value)
    with pytest.raises(ValueError) as spec_error:
        MapSpec("Say {b}", **kwargs)
    assert message in str(spec_error.value)
    with pytest.raises(ValueError) as polars_error:
        pl.DataFrame({"b": ["x"]}).with_columns(llmops.llm_map("Say {b}", engine=eng, cache_dir=False, **kwargs))
    assert message in str(polars_error.value)
    with pytest.raises(ValueError) as duckdb_error:
        register(duckdb.connect(), name="f", template="Say {b}", engine=eng, cache_dir=False, **kwargs)
    assert message in str(duckdb_error.value)
    assert eng.calls == 0


def test_a_stop_string_is_one_stop():
    assert MapSpec("Say {b}", stop="END").stop == ("END",)
    assert Llm().spec("{b}", stop="END", choices=["a", "b"]).stop == ("END",)


def test_finite_parameters_still_run():
    eng = FakeLLM()
    out = map_table_ordered(pa.table({"b": ["x"]}), MapSpec("Say {b}", temperature=0.7, seed=3, top_k=5),
                            engine=eng, cache_dir=False)
    assert out.column("output").to_pylist() == ["echo: Say x"] and not math.isnan(eng.last_params.temperature)


# ---- DuckDB: a STRUCT or JSON value is one value (its JSON text), whatever its fields are called

@pytest.mark.parametrize("value, shown", [
    ("{'doc': 'inner', 'title': 'T'}", '{"doc": "inner", "title": "T"}'),
    ("'{\"doc\": \"inner\", \"n\": 1}'::JSON", '{"doc": "inner", "n": 1}'),
    ("{'title': 'Café'}", '{"title": "Café"}'),
    ("{'doc': 'named'}", "named"),                    # a struct whose fields are exactly the placeholder names it
])
def test_duckdb_struct_and_json_values_render_as_json_text(value, shown):
    eng = FakeLLM()
    con = duckdb.connect()
    register(con, engine=eng, cache_dir=False)
    (row,) = con.execute(f"SELECT llm_map('{{doc}}', doc) FROM (SELECT {value} AS doc)").fetchall()
    assert row[0] == f"echo: {shown}"


# ---- llmops generate: one prompt per "\n"-terminated line

def test_generate_splits_lines_at_newline_only(fake):
    text = "one\u2028two\nthree\x0cfour\r\nfive\x1cstill five\n\n"
    result = CliRunner().invoke(main, ["generate", "--no-cache", "--jsonl"], input=text.encode())
    assert result.exit_code == 0, result.output
    rows = [json.loads(x) for x in result.stdout.split("\n") if x]
    assert [(r["row"], r["output"]) for r in rows] == [
        (0, "echo: one\u2028two"), (1, "echo: three\x0cfour"), (2, "echo: five\x1cstill five")]


# ---- semantic operators

def test_llm_reduce_leaves_null_items_out():
    eng = FakeLLM()
    table = pa.table({"g": ["a", "a", "a", "b"], "note": ["first", None, "third", None]})
    out, _ = llm_reduce_table(table, ["g"], "Summarise:\n{rows}", Llm(engine=eng, cache_dir=False), item="- {note}")
    prompts = list(eng.seen)
    assert len(prompts) == 1 and "None" not in prompts[0] and "- first\\n- third" in prompts[0]
    assert out.column("g").to_pylist() == ["a", "b"]
    assert out.column("output").to_pylist()[1] is None
    assert out.column("output_error").to_pylist()[1] == "group {'g': 'b'}: nothing to reduce (every row's note is null)"


@pytest.mark.parametrize("ids, message", [
    (["x", "x", "y"], "resolve.id_column 'id' is not unique: 'x' is on rows 0 and 1"),
    (["x", None, "y"], "resolve.id_column 'id' is null at row 1"),
])
def test_resolve_needs_a_unique_id_column(ids, message):
    eng = FakeLLM()
    table = pa.table({"id": ids, "name": ["Ann Lee", "Ann Lee", "Bob Stone"]})
    with pytest.raises(ValueError) as info:
        resolve_table(table, ["name"], Llm(engine=eng, cache_dir=False), id_column="id")
    assert message in str(info.value) and eng.calls == 0


@pytest.mark.parametrize("option, message", [
    (["--temperature", "nan"], "temperature must be a finite number, got nan"),
    (["--temperature", "inf"], "temperature must be a finite number, got inf"),
    (["--choices", "yes,yes"], "choices[1] 'yes' is given twice"),
    (["--choices", "yes,,no"], "choices[1] must not be empty"),
])
def test_generate_options_exit_2_before_any_work(option, message, fake):
    result = CliRunner().invoke(main, ["generate", "--no-cache", *option], input=b"a line\n")
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.output, result.output
    assert fake.calls == 0
