"""llm_map as a Polars expression: eager, lazy, streaming, dtypes, nulls, the called-once guard."""
from __future__ import annotations

import polars as pl
import pytest

import llmops
import llmops.polars_namespace  # noqa: F401  (registers .llm)
from helpers.fake_engine import FakeLLM
from llmops.polars import llm_map
from llmops.templates import TemplateError


@pytest.fixture
def df():
    return pl.DataFrame({"body": ["a b", None, "a b", "c d", "e f"], "n": [1, 2, 3, 4, 5]})


@pytest.mark.parametrize("mode", ["eager", "lazy", "streaming"])
def test_modes_give_the_same_result_and_generate_once(df, mode):
    eng = FakeLLM()
    expr = llmops.llm_map("Say {body}", engine=eng, cache_dir=False).alias("out")
    if mode == "eager":
        out = df.with_columns(expr)
    else:
        out = df.lazy().with_columns(expr).collect(engine="streaming" if mode == "streaming" else "in-memory")
    assert out["out"].to_list() == ["echo: Say a b", None, "echo: Say a b", "echo: Say c d", "echo: Say e f"]
    assert out.schema["out"] == pl.String
    assert eng.prompts_seen == 3                      # morsels of one job: a prompt is generated once


def test_struct_output_dtype_and_unnest_called_once(df):
    eng = FakeLLM()
    expr = llm_map("Extract {body} {n}", schema={"city": pl.String, "zip": pl.Int32}, engine=eng, cache_dir=False)
    out = df.lazy().select(expr.struct.unnest()).collect()
    assert out.schema == pl.Schema({"city": pl.String, "zip": pl.Int32})
    assert out["city"].null_count() == 1 and out["city"][0].startswith("city-")
    assert set(eng.seen.values()) == {1} and eng.prompts_seen == 4
    eager = df.with_columns(llm_map("Extract {body} {n}", schema={"city": str}, engine=eng,
                                    cache_dir=False).alias("f")).unnest("f")
    assert eager.schema["city"] == pl.String and set(eng.seen.values()) == {2}


def test_repeated_input_on_the_same_expression_is_served_from_memory(df):
    eng = FakeLLM()
    expr = llm_map("Say {body}", engine=eng, cache_dir=False)
    first = df.select(expr)
    second = df.select(expr)
    assert first.equals(second) and eng.calls == 1


def test_choices_meta_and_namespace(df):
    eng = FakeLLM()
    out = df.with_columns(pl.col("body").llm.map("Pick for {text}", choices=["a", "c", "z"], engine=eng,
                                                 cache_dir=False, with_meta=True).alias("m"))
    assert out.schema["m"] == pl.Struct({"output": pl.Enum(["a", "c", "z"]), "finish_reason": pl.String, "error": pl.String,
                                         "text": pl.String, "prompt_tokens": pl.Int64, "completion_tokens": pl.Int64,
                                         "confidence": pl.Float64, "model": pl.String})
    m = out["m"].struct.unnest()
    assert m["output"].to_list()[:4] == ["a", None, "a", "c"]
    assert m["finish_reason"].to_list()[:2] == ["stop", None]
    with pytest.raises(TemplateError, match="exactly one placeholder"):
        pl.col("body").llm.map("{a} {b}")


def test_columns_binding_and_errors(df):
    eng = FakeLLM()
    out = df.select(llm_map("{x}!", columns={"x": pl.col("body").str.to_uppercase()}, engine=eng,
                            cache_dir=False))
    assert out.to_series().to_list()[0] == "echo: A B!"
    with pytest.raises(pl.exceptions.ColumnNotFoundError, match=r'"nope".*valid columns'):
        df.select(llm_map("{nope}", engine=eng, cache_dir=False))
    with pytest.raises(ValueError, match="no {column} placeholder"):
        llm_map("constant", engine=eng)
    assert eng.calls == 1


def test_empty_frame_does_not_generate():
    eng = FakeLLM()
    out = pl.DataFrame({"body": []}, schema={"body": pl.String}).select(llm_map("{body}", engine=eng))
    assert out.height == 0 and eng.calls == 0
