"""`llm_extract` with quotes: every non-null value is a verbatim span of its source text (found as written, or
snapped to the text's own spelling), misquoted rows get a gleaning round, and values still not in the text are
nulled with an error naming the field."""
from __future__ import annotations

import json

import duckdb
import polars as pl
import pyarrow as pa
import pytest

import llmops
from helpers.fake_engine import FakeLLM
from helpers.paths import REPO
from helpers.scripted_engine import ScriptedLLM
from helpers.skips import requires_smollm2
from llmops.pipeline.load import load_pipeline
from llmops.pipeline.runner import run_pipeline
from llmops.semantic import duckdb as sem_duckdb
from llmops.semantic import Llm
from llmops.semantic.extract import llm_extract_table, locate

BODIES = ["Invoice INV-1 for $500 is due  on 3 May.", "Please pay invoice A-77, total 12.50 EUR.",
          "Your bill B-3 totals 80 USD.", None, "Nothing to see here."]
FIRST = {"INV-1": {"number": "inv-1", "total": "$500"},           # case differs: snapped to "INV-1"
         "A-77": {"number": "A-78", "total": "12.50 EUR"},        # a made-up number: gleaned
         "B-3": {"number": "B-4", "total": "80 usd"},             # made up twice: nulled
         "Nothing": {"number": "", "total": ""}}
AGAIN = {"A-77": {"number": "A-77", "total": "12.50 EUR"}, "B-3": {"number": "B-5", "total": "80 USD"}}


def _answer(text: str, params) -> str:
    key = next(k for k in FIRST if k in text.split("Text: ", 1)[1].split("\n")[0])
    again = "Your previous answer" in text
    return json.dumps(AGAIN[key] if again else FIRST[key])


def _extract(engine, **kw):
    table = pa.table({"id": list(range(len(BODIES))), "body": BODIES})
    return llm_extract_table(table, "body", {"number": "the invoice number", "total": "the amount"},
                             Llm.of(engine=engine, cache_dir=False, progress=False), **kw)


def test_every_value_is_a_quote_of_its_source():
    engine = ScriptedLLM(_answer)
    out, report = _extract(engine)
    values = out.column("extracted").to_pylist()
    for source, value in zip(BODIES, values):
        for v in (value or {}).values():
            assert v is None or v in source
    assert values[0] == {"number": "INV-1", "total": "$500"}
    assert values[1] == {"number": "A-77", "total": "12.50 EUR"}
    assert values[2] == {"number": None, "total": "80 USD"}
    assert values[3] is None and values[4] == {"number": None, "total": None}
    errors = out.column("extracted_error").to_pylist()
    assert errors[2] == "row 2: not a quote of 'body', set to null: number = \"B-4\"" and errors[0] is None
    assert report.gleaned == 2 and report.not_quotes == 1 and engine.calls == 2


def test_without_quotes_values_are_kept_as_answered():
    out, _ = _extract(ScriptedLLM(_answer), quotes=False)
    assert out.column("extracted").to_pylist()[2] == {"number": "B-4", "total": "80 usd"}


def test_fabricating_fake_gives_only_nulls_with_reasons():
    out, report = _extract(FakeLLM(), gleaning=0)      # the plain fake invents values ("number-123")
    assert all(v is None for row in out.column("extracted").to_pylist() if row for v in row.values())
    assert report.values == 0 and report.gleaned == 0
    assert "not a quote of 'body'" in out.column("extracted_error")[0].as_py()


@pytest.mark.parametrize("value, source, expected", [
    ("INV-1", "see INV-1 now", "INV-1"), ("inv-1", "see INV-1 now", "INV-1"),
    ("due on 3 May", "is due  on\n3 May.", "due  on\n3 May"), ('"A-77."', "pay A-77, now", "A-77"),
    ("A-78", "pay A-77, now", None), ("", "x", None),
])
def test_locate(value, source, expected):
    assert locate(value, source) == expected


@pytest.mark.parametrize("fields, column, error", [
    ([], "body", "at least one field"), (["x"], "nope", "unknown column"),
])
def test_bad_arguments(fields, column, error):
    with pytest.raises(ValueError, match=error):
        llm_extract_table(pa.table({"body": ["a"]}), column, fields, Llm.of(engine=FakeLLM(), cache_dir=False))


def test_polars_llm_extract():
    df = pl.DataFrame({"body": BODIES})
    out = llmops.llm_extract(df, "body", ["number", "total"], engine=ScriptedLLM(_answer), cache_dir=False)
    assert out["extracted"].struct.field("number").to_list()[:2] == ["INV-1", "A-77"]


@requires_smollm2
def test_smollm2_extracted_values_are_quotes():
    bodies = ["Invoice INV-2023-6469 for $8,381.80 is due on 12 March 2025.",
              "Acme Office Supply - invoice A-3203. Amount due: 5,738.22 EUR."]
    out, report = llm_extract_table(pa.table({"body": bodies}), "body", {"invoice_number": "the invoice number"},
                                    Llm.of(cache_dir=False, progress=False))
    for source, value in zip(bodies, out.column("extracted").to_pylist()):
        assert value is None or value["invoice_number"] is None or value["invoice_number"] in source
    assert report.rows == 2


def test_extract_sample_pipeline_keeps_only_quotes(tmp_path):
    sets = ["cache_dir=false", f"sink={{parquet: {tmp_path / 'out.parquet'}}}"]
    pipeline = load_pipeline(REPO / "pipelines" / "semantic" / "extract_quotes.yaml", overrides=sets)
    bodies = pl.read_csv(REPO / "sample_data" / "invoices.csv")["body"].to_list()[:8]

    def quote_first_word(text: str, params) -> str:     # a real quote for one field, a made-up one for the other
        body = text.split("Text: ", 1)[1].split("\n")[0]
        return json.dumps({"invoice_number": body.split()[0], "total": "one million"})

    result = run_pipeline(pipeline, limit=8, engine=ScriptedLLM(quote_first_word), progress=False)
    out = pl.read_parquet(tmp_path / "out.parquet")
    assert out.columns == ["id", "invoice_number", "total", "quote_error"] and result.rows_written == 8
    assert all(n in b for n, b in zip(out["invoice_number"].to_list(), bodies))
    assert out["total"].null_count() == 8 and all("total = " in e for e in out["quote_error"].to_list())
    assert result.llm_steps[0]["not_quotes"] == 8 and result.llm_steps[0]["gleaned"] == 8


def test_duckdb_llm_extract():
    con = duckdb.connect()
    con.register("mails", pa.table({"body": BODIES[:2]}))
    rel = sem_duckdb.llm_extract(con, "SELECT * FROM mails", "body", ["number", "total"], engine=ScriptedLLM(_answer),
                                 cache_dir=False)
    assert con.sql("SELECT extracted.number FROM rel").fetchall() == [("INV-1",), ("A-77",)]
