"""Embeddings through `llmops.core.embed_texts`: an embedding column (one engine call, identical texts once, nulls
and errors per row), `sim_join` by cosine similarity (k nearest, threshold) and `blocking="embedding"` for
`resolve` and `llm_join`."""
from __future__ import annotations

import math

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa
import pytest

import llmops
from helpers.paths import REPO
from helpers.scripted_engine import ScriptedLLM
from helpers.skips import requires_smollm2
from llmops.core import embed_texts
from llmops.pipeline.load import PipelineError, load_pipeline
from llmops.pipeline.plan import plan_pipeline
from llmops.pipeline.runner import run_pipeline
from llmops.semantic import duckdb as sem_duckdb
from llmops.semantic import Llm, llm_join_table, resolve_table
from llmops.semantic.embed import embed_table, nearest, sim_join_table
from llmops.semantic.blocking import Blocking
from llmops.semantic.embed_blocking import EmbeddingBlocking, as_blocking, pairs_for

WORDS = ["apple", "banana", "cherry", "phone", "laptop", "red", "green"]


def _llm(engine, **kw) -> Llm:
    return Llm.of(engine=engine, cache_dir=False, progress=False, **kw)


def test_embed_texts_dedupes_and_keeps_nulls_and_errors():
    engine = ScriptedLLM(vocabulary=WORDS)
    vectors, errors = embed_texts(["apple phone", None, "apple phone", "!!!", "red apple"], engine=engine)
    assert engine.embed_calls == 1 and engine.embedded == 3
    assert vectors[0] == vectors[2] and vectors[1] is None and errors[1] is None
    assert vectors[3] is None and errors[3] == "empty text"
    assert math.isclose(sum(x * x for x in vectors[4]), 1.0)


def test_embed_table_adds_a_list_column_and_errors():
    table = pa.table({"id": [1, 2, 3], "text": ["apple", None, "..."]})
    out = embed_table(table, "text", _llm(ScriptedLLM(vocabulary=WORDS)))
    assert out.schema.field("embedding").type == pa.list_(pa.float32())
    assert out.column("embedding").to_pylist()[1] is None
    assert out.column("embedding_error").to_pylist() == [None, None, "row 2: empty text"]


def test_polars_embed_has_float32_list_dtype():
    df = llmops.embed(pl.DataFrame({"text": ["apple", "banana"]}), "text", engine=ScriptedLLM(vocabulary=WORDS))
    assert df["embedding"].dtype == pl.List(pl.Float32) and len(df["embedding"][0]) == len(WORDS)


@pytest.mark.parametrize("k, threshold, skip_self", [(1, None, False), (2, 0.5, False), (None, 0.9, True)])
def test_nearest_matches_brute_force(k, threshold, skip_self):
    rng = np.random.default_rng(0)
    a = rng.normal(size=(20, 8)).astype(np.float32)
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    b = a if skip_self else rng.normal(size=(15, 8)).astype(np.float32)
    got = list(nearest(a, b, k=k, threshold=threshold, skip_self=skip_self))
    sims = a @ b.T
    want = []
    for i in range(len(a)):
        order = [j for j in np.argsort(-sims[i], kind="stable") if not (skip_self and j == i)][:k]
        want += [(i, int(j)) for j in order if threshold is None or sims[i, j] >= threshold]
    assert [(i, j) for i, j, _ in got] == want


def test_sim_join_k_nearest_and_threshold():
    left = pa.table({"id": [1, 2], "name": ["red apple", "green laptop"]})
    right = pa.table({"id": [10, 11, 12], "name": ["apple red", "laptop", "banana"]})
    engine = ScriptedLLM(vocabulary=WORDS)
    out = sim_join_table(left, right, _llm(engine), left_on="name", k=1)
    assert out.column_names == ["id", "name", "id_right", "name_right", "similarity"]
    assert out.column("id_right").to_pylist() == [10, 11] and engine.embed_calls == 1
    assert out.column("similarity")[0].as_py() == pytest.approx(1.0)
    strict = sim_join_table(left, right, _llm(engine), left_on="name", threshold=0.99)
    assert strict.column("id_right").to_pylist() == [10]


@pytest.mark.parametrize("kw, error", [
    ({}, "give k"), ({"k": 0}, "positive integer"), ({"threshold": 2}, r"\[-1, 1\]"),
])
def test_sim_join_rejects_bad_settings(kw, error):
    t = pa.table({"name": ["a"]})
    with pytest.raises(ValueError, match=error):
        sim_join_table(t, t, _llm(ScriptedLLM(vocabulary=WORDS)), left_on="name", **kw)


def test_as_blocking_spellings():
    assert as_blocking(None) == Blocking() and as_blocking("embedding") == EmbeddingBlocking()
    assert as_blocking({"method": "embedding", "top_k": 3}) == EmbeddingBlocking(top_k=3)
    assert as_blocking({"threshold": 0.5}) == Blocking(threshold=0.5)
    with pytest.raises(ValueError, match="method must be"):
        as_blocking({"method": "magic"})


def test_embedding_blocking_pairs_are_nearest_neighbours():
    texts = ["red apple", "apple red", "green laptop", "laptop green", "banana"]
    pairs = pairs_for(EmbeddingBlocking(top_k=1, threshold=0.5), texts, [], _llm(ScriptedLLM(vocabulary=WORDS)))
    assert set(pairs) == {(0, 1), (2, 3)}


def _same_when_words_match(text: str, params) -> str:
    a, b = (line.split(": ", 1)[1] for line in text.split("\n")[:2])
    return "Same" if sorted(a.split()) == sorted(b.split()) else "Different"


def test_resolve_with_embedding_blocking():
    table = pa.table({"name": ["red apple", "apple red", "green laptop", "laptop green", "banana"]})
    engine = ScriptedLLM(_same_when_words_match, vocabulary=WORDS)
    out, report = resolve_table(table, "name", _llm(engine), blocking=EmbeddingBlocking(top_k=1))
    assert out.column("entity_id").to_pylist() == [0, 0, 2, 2, 4]
    assert engine.embed_calls == 1 and report.compared_pairs < report.all_pairs


def test_llm_join_with_embedding_blocking_polars():
    left = pl.DataFrame({"name": ["red apple", "green laptop"]})
    right = pl.DataFrame({"title": ["laptop green", "apple red", "banana"]})
    engine = ScriptedLLM(_same_when_words_match, vocabulary=WORDS)
    out = llmops.llm_join(left, right, left_on="name", right_on="title", blocking="embedding", engine=engine,
                          cache_dir=False)
    assert sorted(zip(out["name"], out["title"])) == [("green laptop", "laptop green"), ("red apple", "apple red")]


def test_llm_join_table_takes_embedding_blocking_keys():
    left = pa.table({"name": ["x"], "sku": ["S1"]})
    right = pa.table({"name": ["y"], "sku": ["S1"]})
    out, report = llm_join_table(left, right, _llm(ScriptedLLM(lambda t, p: "Same", vocabulary=WORDS)),
                                 left_on="name", blocking=EmbeddingBlocking(keys=("sku",), threshold=0.99))
    assert report.candidate_pairs == 1 and out.num_rows == 1


@requires_smollm2
def test_smollm2_sim_join_pairs_similar_sentences():
    left = pa.table({"text": ["The cat sat on the mat.", "Quarterly revenue grew by 12 percent."]})
    right = pa.table({"text": ["Sales increased twelve percent this quarter.", "A kitten is sitting on a rug."]})
    out = sim_join_table(left, right, Llm.of(cache_dir=False, progress=False), left_on="text", k=1)
    assert out.column("text_right").to_pylist() == ["A kitten is sitting on a rug.",
                                                    "Sales increased twelve percent this quarter."]


def _pipeline(tmp_path, steps: str, source: str = "sample_data/products_left.csv"):
    path = tmp_path / "p.yaml"
    path.write_text(f"cache_dir: false\nsource: {{csv: {REPO / source}}}\nsteps:\n{steps}\n"
                    f"sink: {{parquet: {tmp_path / 'out.parquet'}}}\n")
    return load_pipeline(path)


def test_embed_and_sim_join_steps(tmp_path):
    right = REPO / "sample_data" / "products_right.csv"
    steps = ("  - embed: {column: title, output: vec}\n"
             f"  - sim_join: {{right: \"SELECT * FROM read_csv('{right}', all_varchar = true)\",\n"
             "      left_on: [title], k: 2}")
    engine = ScriptedLLM()
    result = run_pipeline(_pipeline(tmp_path, steps), limit=10, engine=engine, progress=False)
    out = pl.read_parquet(tmp_path / "out.parquet")
    assert out.height == 20 and {"vec", "title_right", "similarity"} <= set(out.columns)
    assert out["vec"].dtype == pl.List(pl.Float32) and result.llm_steps[1]["pairs"] == 20
    assert engine.embed_calls == 2


def test_sim_join_sample_pipeline_plans_without_a_model(tmp_path):
    sets = [f"sink={{parquet: {tmp_path / 'out.parquet'}}}"]
    plan = plan_pipeline(load_pipeline(REPO / "pipelines/semantic/similar_products.yaml", overrides=sets),
                         estimate=False)
    assert plan["output_columns"] == ["id", "title", "id_right", "title_right", "similarity"]


def test_resolve_step_with_embedding_blocking(tmp_path):
    steps = "  - resolve: {columns: [name], blocking: {method: embedding, top_k: 2}, id_column: id}"
    engine = ScriptedLLM(lambda text, params: "Different")
    result = run_pipeline(_pipeline(tmp_path, steps, "sample_data/customers_dupes.csv"), limit=30, engine=engine,
                          progress=False)
    step = result.llm_steps[0]
    assert engine.embed_calls == 1 and 0 < step["candidate_pairs"] <= 30 * 2 and step["entities"] == 30


@pytest.mark.parametrize("blocking, message", [
    ("{method: embedding, q: 3}", "takes no q"), ("{method: vectors}", "method"), ("{threshold: -0.5}", r"\[0, 1\]"),
])
def test_bad_blocking_settings_fail_at_load(tmp_path, blocking, message):
    with pytest.raises(PipelineError, match=message):
        _pipeline(tmp_path, f"  - resolve: {{columns: [name], blocking: {blocking}}}",
                  "sample_data/customers_dupes.csv")


def test_duckdb_embed_and_sim_join():
    con = duckdb.connect()
    con.register("a", pa.table({"name": ["red apple", "green laptop"]}))
    con.register("b", pa.table({"name": ["laptop green", "apple red"]}))
    engine = ScriptedLLM(vocabulary=WORDS)
    rel = sem_duckdb.embed(con, "SELECT * FROM a", "name", engine=engine)
    assert con.sql("SELECT len(embedding) FROM rel").fetchall() == [(len(WORDS),), (len(WORDS),)]
    joined = sem_duckdb.sim_join(con, "SELECT * FROM a", "SELECT * FROM b", on="name", k=1, engine=engine)
    assert con.sql("SELECT name, name_right FROM joined ORDER BY name").fetchall() == [
        ("green laptop", "laptop green"), ("red apple", "apple red")]
