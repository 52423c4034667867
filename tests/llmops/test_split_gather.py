"""`split` / `gather`: long texts cut into overlapping chunks (characters or tokens) with (doc_id, chunk_index),
a per-chunk map, and the chunks' results put back per document (joined, or reduced by the model)."""
from __future__ import annotations

import json

import duckdb
import polars as pl
import pyarrow as pa
import pytest

import llmops
from helpers.fake_engine import CharTokenizer, FakeLLM
from helpers.paths import REPO
from helpers.scripted_engine import ScriptedLLM
from helpers.skips import requires_smollm2
from llmops.core import MapSpec, map_table_ordered
from llmops.pipeline.load import PipelineError, load_pipeline
from llmops.pipeline.runner import run_pipeline
from llmops.semantic import duckdb as sem_duckdb
from llmops.semantic import Llm
from llmops.semantic.split import char_chunks, gather_table, split_table, token_chunks

TEXT = " ".join(f"word{i}" for i in range(60))          # 60 words, 479 characters


@pytest.mark.parametrize("size, overlap", [(50, 0), (50, 10), (120, 30), (1000, 0)])
def test_char_chunks_cover_the_text_in_order(size, overlap):
    chunks = char_chunks(TEXT, size, overlap)
    assert all(len(c) <= size for c in chunks)
    assert chunks[0].startswith("word0 ") and chunks[-1].endswith(" word59")
    words = [w for c in chunks for w in c.split()]
    assert set(words) == set(TEXT.split())              # no word lost, none cut in two
    if overlap:
        assert all(a[-overlap:].strip() and a[-overlap:].strip().split()[-1] in b for a, b in zip(chunks, chunks[1:]))


def test_token_chunks_have_size_and_overlap():
    chunks = token_chunks("abcdefghij", 4, 1, CharTokenizer())
    assert chunks == ["abcd", "defg", "ghij"]


def test_split_table_keeps_ids_order_and_other_columns():
    table = pa.table({"id": ["a", "b", "c"], "title": ["T1", "T2", "T3"], "text": [TEXT, "short", None]})
    out = split_table(table, "text", chunk_size=100, overlap=20, id_column="id")
    assert out.column_names == ["id", "title", "doc_id", "chunk_index", "chunk"]
    ids, index = out.column("doc_id").to_pylist(), out.column("chunk_index").to_pylist()
    n = ids.count("a")
    assert n > 4 and index[:n] == list(range(n)) and ids[n:] == ["b", "c"]
    assert out.column("chunk").to_pylist()[n:] == ["short", None]   # a null text keeps one (null) chunk


@pytest.mark.parametrize("kw, error", [
    ({"chunk_size": 0}, "chunk_size >= 1"), ({"chunk_size": 10, "overlap": 10}, "overlap < chunk_size"),
    ({"chunk_size": 10, "unit": "words"}, "unit must be"), ({"chunk_size": 10, "unit": "tokens"}, "tokenizer"),
    ({"chunk_size": True}, "must be an integer"),
])
def test_split_rejects_bad_settings(kw, error):
    with pytest.raises(ValueError, match=error):
        split_table(pa.table({"text": ["abc"]}), "text", **kw)


def test_split_map_gather_round_trip_concatenates_in_order():
    docs = pa.table({"id": [1, 2], "text": [TEXT, "tiny doc"]})
    chunks = split_table(docs, "text", chunk_size=80, id_column="id")
    shuffled = chunks.take(pa.array(list(range(chunks.num_rows))[::-1]))     # gather sorts by chunk_index
    out, report = gather_table(shuffled, "chunk", by="doc_id", output="text")
    assert report is None and out.column("doc_id").to_pylist() == [2, 1]
    assert out.column("text").to_pylist()[1].split() == TEXT.split()


def test_gather_with_template_reduces_with_the_model_in_one_call_per_level():
    engine = ScriptedLLM(lambda text, params: "SUMMARY")
    docs = pa.table({"id": [1, 2], "text": [TEXT, "tiny doc"]})
    chunks = split_table(docs, "text", chunk_size=80, id_column="id")
    mapped = chunks.append_column("note", map_table_ordered(chunks, MapSpec("Summarise: {chunk}"), engine=FakeLLM(),
                                                             cache_dir=False).column("output"))
    out, report = gather_table(mapped, "note", template="Combine these notes:\n{rows}",
                               llm=Llm.of(engine=engine, cache_dir=False, progress=False))
    assert out.column("note").to_pylist() == ["SUMMARY", "SUMMARY"] and report.groups == 2
    assert engine.calls == len(report.levels)
    first = next(p for p in engine.seen)
    assert "echo: Summarise: word0" in first              # the chunks' notes, in chunk order


def test_polars_split_and_gather():
    df = pl.DataFrame({"text": [TEXT]})
    chunks = llmops.split(df, "text", chunk_size=100, overlap=10)
    assert chunks["doc_id"].to_list() == [0] * chunks.height and chunks.height > 4
    back = llmops.gather(chunks, "chunk", separator=" | ")
    assert back.height == 1 and " | " in back["chunk"][0]


@requires_smollm2
def test_smollm2_split_by_tokens():
    df = pl.DataFrame({"text": [TEXT]})
    chunks = llmops.split(df, "text", chunk_size=32, overlap=4, unit="tokens")
    assert chunks.height > 2 and all(0 < len(c) for c in chunks["chunk"].to_list())


def _sample(name: str, tmp_path, **overrides):
    """A sample pipeline of pipelines/semantic/, its sink in `tmp_path`, no result cache."""
    sets = ["cache_dir=false", f"sink={{csv: {tmp_path / 'out.csv'}}}"] + [f"{k}={v}" for k, v in overrides.items()]
    return load_pipeline(REPO / "pipelines" / "semantic" / name, overrides=sets)


def _first_words(text: str, params) -> str:
    """The chunk's first two words as the quoted problem."""
    chunk = text.split("Text: ", 1)[1].split("\n")[0]
    return json.dumps({"problem": " ".join(chunk.split()[:2])})


def test_split_extract_gather_sample_pipeline_runs(tmp_path):
    pipeline = _sample("split_gather_tickets.yaml", tmp_path)
    result = run_pipeline(pipeline, limit=6, engine=ScriptedLLM(_first_words), progress=False)
    out = pl.read_csv(tmp_path / "out.csv")
    bodies = pl.read_csv(REPO / "sample_data" / "tickets.csv")["body"].to_list()[:6]
    assert out.columns == ["doc_id", "problem"] and out.height == 6 and result.rows_written == 6
    for body, joined in zip(bodies, out["problem"].to_list()):
        parts = joined.split(" | ")
        assert len(parts) > 1 and all(p in body for p in parts)          # each chunk's quote, in order
    split_step = next(s for s in result.llm_steps if s.get("chunks"))
    assert split_step["documents"] == 6 and split_step["chunks"] > 6


def test_split_by_tokens_and_gather_with_template_in_a_pipeline(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(f"cache_dir: false\nsource: {{csv: {REPO / 'sample_data/tickets.csv'}}}\nsteps:\n"
                    "  - split: {column: body, chunk_size: 40, overlap: 5, unit: tokens, id_column: id}\n"
                    "  - llm_map: {output: note, template: 'Note: {chunk}'}\n"
                    "  - gather: {column: note, template: 'Combine:\\n{rows}', output: summary, max_new_tokens: 6}\n"
                    f"sink: {{parquet: {tmp_path / 'out.parquet'}}}\n")
    result = run_pipeline(load_pipeline(path), limit=3, engine=FakeLLM(), progress=False)
    out = pl.read_parquet(tmp_path / "out.parquet")
    assert out.columns == ["doc_id", "summary", "summary_error"] and out.height == 3
    assert result.failed_rows == 0


@pytest.mark.parametrize("step, message", [
    ("split: {column: body, chunk_size: 10, overlap: 10}", "overlap .* must be smaller"),
    ("split: {column: body, chunk_size: 10, temperature: 1}", "unknown key 'temperature'"),
    ("gather: {column: note, temperature: 0.5}", "only apply with a template"),
    ("gather: {column: note, template: 'no rows'}", r"must contain \{rows\}"),
])
def test_bad_split_and_gather_steps_fail_at_load(tmp_path, step, message):
    path = tmp_path / "p.yaml"
    path.write_text(f"source: {{csv: {REPO / 'sample_data/tickets.csv'}}}\nsteps:\n  - {step}\n"
                    f"sink: {{csv: {tmp_path / 'o.csv'}}}\n")
    with pytest.raises(PipelineError, match=message):
        load_pipeline(path)


def test_duckdb_split_and_gather():
    con = duckdb.connect()
    con.register("docs", pa.table({"id": [7], "text": [TEXT]}))
    chunks = sem_duckdb.split(con, "SELECT * FROM docs", "text", chunk_size=100, id_column="id")
    assert con.sql("SELECT count(*), min(doc_id) FROM chunks").fetchall() == [(5, 7)]
    back = sem_duckdb.gather(con, chunks, "chunk", separator=" ")
    assert con.sql("SELECT chunk FROM back").fetchall()[0][0].split() == TEXT.split()
