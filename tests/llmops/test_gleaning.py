"""Gleaning (`llmops.glean`): invalid or unsure rows are re-prompted with their previous answer and why it failed,
one engine call per round, and each row keeps the better answer; the `gleaning` option of `llm_map`."""
from __future__ import annotations

import polars as pl
import pyarrow as pa
import pytest

import llmops
from helpers.paths import REPO
from helpers.scripted_engine import ScriptedLLM
from llmops.core import MapSpec
from llmops.glean import Gleaning, as_gleaning, rules_judge, run_gleaned
from llmops.pipeline.load import PipelineError, load_pipeline
from llmops.pipeline.runner import run_pipeline
from llmops.validate import RETRY_SUFFIX

TABLE = pa.table({"q": ["one", "two", "three"]})
OVER_TEN = rules_judge(["TRY_CAST(output AS INT) > 10"], "output")


def _answers(first: dict[str, object], again: dict[str, object]):
    """The first answer per row text, and the answer once the prompt carries the feedback."""
    def answer(text: str, params):
        row = next(k for k in first if k in text.split("\n")[0])
        return again[row] if "Your previous answer" in text else first[row]
    return answer


def _run(engine, spec, **kw):
    return run_gleaned(TABLE, spec, cache_dir=False, progress=False, engine=engine, **kw)


def test_rule_failures_are_refined_in_one_call_and_fixed():
    engine = ScriptedLLM(_answers({"one": "5", "two": "50", "three": "7"}, {"one": "42", "two": "50", "three": "3"}))
    out = _run(engine, MapSpec("{q}"), gleaning=Gleaning(1), judge=OVER_TEN)
    assert out.table.column("output").to_pylist() == ["42", "50", None]
    assert out.table.column("attempts").to_pylist() == [2, 1, 1]        # row 3 kept its first (still failing) answer
    assert out.retried == 2 and out.rejected == 1 and engine.calls == 2
    assert "rejected after 2 attempt(s)" in out.table.column("error")[2].as_py()
    assert "TRY_CAST(output AS INT) > 10" in out.table.column("error")[2].as_py()
    refined = [p for p in engine.seen if "Your previous answer" in p]
    assert len(refined) == 2 and any('"5"' in p or "5" in p for p in refined)


def test_without_reject_the_better_of_two_failing_answers_stays():
    engine = ScriptedLLM(_answers({"one": "5", "two": "50", "three": "7"}, {"one": "6", "two": "50", "three": "8"}))
    out = _run(engine, MapSpec("{q}"), gleaning=Gleaning(2), judge=OVER_TEN,
               reject=False)
    assert out.table.column("output").to_pylist() == ["5", "50", "7"]   # ties keep the earlier answer
    assert out.rejected == 0 and out.retried == 4 and engine.calls == 3
    assert any('{"data": "6"}' in p for p in engine.seen)                # round 2 shows round 1's answer


def test_low_confidence_rows_keep_the_surer_answer():
    first = {"one": ("A", 0.4), "two": ("A", 0.95), "three": ("A", 0.5)}
    again = {"one": ("B", 0.9), "two": ("B", 0.99), "three": ("B", 0.3)}
    engine = ScriptedLLM(_answers(first, again))
    out = _run(engine, MapSpec("{q}", choices=("A", "B")), gleaning=Gleaning(1, min_confidence=0.8))
    assert out.table.column("output").to_pylist() == ["B", "A", "A"]
    assert out.table.column("confidence").to_pylist() == [0.9, 0.95, 0.5]
    assert out.retried == 2


def test_unparsable_output_is_refined():
    engine = ScriptedLLM(_answers({"one": "oops", "two": '{"n": 2}', "three": '{"n": 3}'},
                                  {"one": '{"n": 1}', "two": "", "three": ""}))
    out = _run(engine, MapSpec("{q}", schema={"n": int}), gleaning=Gleaning(1))
    assert out.table.column("output").to_pylist() == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert out.retried == 1


def test_retry_prompt_carries_previous_answer_and_failure_as_data():
    assert "{__llmops_previous}" in RETRY_SUFFIX and "{__llmops_failure}" in RETRY_SUFFIX


@pytest.mark.parametrize("value, constrained, expected", [
    (None, False, None), (0, False, None), (False, False, None), (2, False, Gleaning(2)),
    ({"rounds": 1, "min_confidence": 0.7}, True, Gleaning(1, 0.7)), (Gleaning(3), False, Gleaning(3)),
])
def test_as_gleaning(value, constrained, expected):
    assert as_gleaning(value, constrained=constrained) == expected


@pytest.mark.parametrize("value, constrained, error", [
    (9, False, "from 1 to 5"), ("1", False, "rounds must be an integer"), (True, False, "rounds must be an integer"),
    ({"rounds": 1, "min_confidence": 0.7}, False, "needs a constrained output"),
    ({"round": 1}, False, "unknown key"), ({"min_confidence": 2}, True, r"\(0, 1\]"),
])
def test_as_gleaning_rejects(value, constrained, error):
    with pytest.raises(ValueError, match=error):
        as_gleaning(value, constrained=constrained)


def test_polars_llm_map_gleaning_option():
    engine = ScriptedLLM(_answers({"one": "5", "two": "50", "three": "7"}, {"one": "42", "two": "50", "three": "70"}))
    df = pl.from_arrow(TABLE)
    out = df.select(llmops.llm_map("{q}", validate="TRY_CAST(output AS INT) > 10", gleaning=1, engine=engine,
                                   cache_dir=False).alias("n"))
    assert out["n"].to_list() == ["42", "50", "70"] and engine.calls == 2


def test_polars_llm_map_gleaning_and_max_attempts_conflict():
    with pytest.raises(ValueError, match="gleaning rounds or max_attempts"):
        llmops.llm_map("{q}", validate="output > 1", gleaning=1, max_attempts=3)


def test_pipeline_llm_map_gleaning_key(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(f"cache_dir: false\nsource: {{csv: {REPO / 'sample_data/tickets.csv'}}}\nsteps:\n"
                    "  - llm_map: {output: n, template: 'Number for {subject}', validate: 'TRY_CAST(n AS INT) > 10',"
                    " gleaning: 1}\n"
                    f"sink: {{parquet: {tmp_path / 'out.parquet'}}}\n")
    engine = ScriptedLLM(lambda text, params: "42" if "Your previous answer" in text else "5")
    result = run_pipeline(load_pipeline(path), limit=4, engine=engine, progress=False)
    assert pl.read_parquet(tmp_path / "out.parquet")["n"].to_list() == ["42"] * 4
    assert result.llm_steps[0]["retried"] == 4 and engine.calls == 2


@pytest.mark.parametrize("keys, message", [
    ("gleaning: 9", "from 1 to 5"), ("gleaning: {rounds: 1, min_confidence: 0.5}", "constrained output"),
    ("gleaning: 1, max_attempts: 3", "gleaning rounds or max_attempts"),
])
def test_pipeline_gleaning_key_is_checked_at_load(tmp_path, keys, message):
    path = tmp_path / "p.yaml"
    path.write_text(f"source: {{csv: {REPO / 'sample_data/tickets.csv'}}}\nsteps:\n"
                    f"  - llm_map: {{output: n, template: '{{subject}}', {keys}}}\n"
                    f"sink: {{csv: {tmp_path / 'o.csv'}}}\n")
    with pytest.raises(PipelineError, match=message):
        load_pipeline(path)
