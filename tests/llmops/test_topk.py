"""`llm_topk`: the partial quicksort finds the true top k with far fewer than n^2 comparisons, one engine call
per round, on a fake engine that compares rows by a hidden score; its spellings and pipeline step."""
from __future__ import annotations

import random
import re

import duckdb
import polars as pl
import pyarrow as pa
import pytest

import llmops
from helpers.fake_engine import FakeLLM
from helpers.paths import REPO
from helpers.scripted_engine import ScriptedLLM
from helpers.skips import requires_smollm2
from llmops.pipeline.load import PipelineError, load_pipeline
from llmops.pipeline.plan import plan_pipeline
from llmops.pipeline.runner import run_pipeline
from llmops.semantic import duckdb as sem_duckdb
from llmops.semantic import Llm
from llmops.semantic.topk import llm_topk_table, pair_template, question_text, ranking

N = 200


def _scores(n: int, seed: int = 1) -> dict[str, int]:
    values = list(range(n))
    random.Random(seed).shuffle(values)
    return {f"item{i}": v for i, v in enumerate(values)}


def _judge(scores: dict[str, int]):
    """Answers A or B for the item with the higher hidden score (the fake reads the two items of the prompt)."""
    def answer(text: str, params) -> str:
        a = re.search(r"\nA: (\w+)", text).group(1)
        b = re.search(r"\nB: (\w+)", text).group(1)
        assert params.choices == ("A", "B")
        return "A" if scores[a] > scores[b] else "B"
    return answer


@pytest.mark.parametrize("k", [1, 5, 20])
def test_ranking_is_exact_and_far_below_all_pairs(k):
    scores = list(range(N))
    random.Random(k).shuffle(scores)
    calls = []

    def better(pairs):
        calls.append(len(pairs))
        return [scores[i] > scores[p] for i, p in pairs]

    top, rounds = ranking(N, k, better, random.Random(0))
    assert top == sorted(range(N), key=lambda i: -scores[i])[:k]
    assert rounds == len(calls)
    assert sum(calls) < N * (N - 1) // 2 / 10          # a full tournament compares 19,900 pairs


def test_topk_table_returns_hidden_top_k_in_one_call_per_round():
    scores = _scores(N)
    table = pa.table({"id": list(range(N)), "name": list(scores)})
    engine = ScriptedLLM(_judge(scores))
    out, report = llm_topk_table(table, "Which {name} is the largest?", 5,
                                 Llm.of(engine=engine, cache_dir=False, progress=False))
    best = sorted(scores, key=lambda n: -scores[n])[:5]
    assert out.column("name").to_pylist() == best
    assert out.column("rank").to_pylist() == [1, 2, 3, 4, 5]
    assert report.comparisons < report.all_pairs / 10
    assert engine.calls == report.rounds and report.rounds <= 30
    assert engine.prompts_seen == report.comparisons and report.failed_comparisons == 0


def test_question_and_pair_template_keep_literal_braces():
    assert question_text("Which {name} costs {{most}}?") == "Which name costs {most}?"
    pair = pair_template("Which {name} costs {{most}}?")
    assert "{a}" in pair and "{b}" in pair and "{{most}}" in pair


def test_null_rows_are_not_ranked_and_k_beyond_rows():
    scores = {"item0": 3, "item1": 1, "item2": 2}
    table = pa.table({"name": ["item0", None, "item1", "item2"]})
    out, report = llm_topk_table(table, "Which {name}?", 10,
                                 Llm.of(engine=ScriptedLLM(_judge(scores)), cache_dir=False, progress=False))
    assert out.column("name").to_pylist() == ["item0", "item2", "item1"] and report.ranked == 3


@pytest.mark.parametrize("k, template, error", [
    (0, "Which {name}?", "k must be a positive integer"),
    (2, "Which one?", "names no column"),
    (2, "Which {nope}?", "unknown column"),
])
def test_bad_arguments_name_the_problem(k, template, error):
    with pytest.raises(ValueError, match=error):
        llm_topk_table(pa.table({"name": ["a", "b"]}), template, k, Llm.of(engine=ScriptedLLM(), cache_dir=False))


def test_polars_llm_topk_with_report():
    scores = _scores(30)
    df = pl.DataFrame({"name": list(scores)})
    out, report = llmops.llm_topk(df, "Which {name} is the largest?", 3, engine=ScriptedLLM(_judge(scores)),
                                  cache_dir=False, progress=False, with_report=True)
    assert out["name"].to_list() == sorted(scores, key=lambda n: -scores[n])[:3]
    assert report.k == 3 and report.comparisons > 0


@requires_smollm2
def test_smollm2_topk_runs_end_to_end():
    table = pa.table({"amount": ["5 dollars", "900 dollars", "20 dollars", "3 dollars"]})
    out, report = llm_topk_table(table, "Which {amount} is the largest sum of money?", 2,
                                 Llm.of(cache_dir=False, progress=False))
    assert out.num_rows == 2 and out.column("rank").to_pylist() == [1, 2]
    assert report.comparisons <= report.all_pairs and report.failed_comparisons == 0


def test_topk_sample_pipeline_runs_and_plans(tmp_path):
    sets = ["cache_dir=false", f"sink={{csv: {tmp_path / 'out.csv'}}}"]
    pipeline = load_pipeline(REPO / "pipelines" / "semantic" / "topk_tickets.yaml", overrides=sets)
    plan = plan_pipeline(pipeline, estimate=False)
    assert plan["output_columns"] == ["rank", "id", "subject", "label"] and plan["steps"][0]["prompts"] > 0
    result = run_pipeline(pipeline, engine=FakeLLM(), progress=False)
    out = pl.read_csv(tmp_path / "out.csv")
    assert out["rank"].to_list() == [1, 2, 3, 4, 5] and result.rows_written == 5
    step = result.llm_steps[0]
    assert step["comparisons"] < step["all_pairs"] and step["k"] == 5


def test_topk_step_rejects_bad_k(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(f"source: {{csv: {REPO / 'sample_data/tickets.csv'}}}\nsteps:\n"
                    "  - llm_topk: {template: 'Which {subject}?', k: 0}\n"
                    f"sink: {{csv: {tmp_path / 'o.csv'}}}\n")
    with pytest.raises(PipelineError, match=r"steps\[0\].llm_topk.k"):
        load_pipeline(path)


def test_duckdb_llm_topk():
    scores = _scores(12)
    con = duckdb.connect()
    con.register("items", pa.table({"name": list(scores)}))
    rel = sem_duckdb.llm_topk(con, "SELECT * FROM items", "Which {name} is the largest?", k=2,
                              engine=ScriptedLLM(_judge(scores)), cache_dir=False)
    assert [r[0] for r in rel.fetchall()] == sorted(scores, key=lambda n: -scores[n])[:2]
