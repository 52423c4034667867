"""Cascades (llmops.cascade): which rows escalate, the model and confidence columns, one job per model, the result
cache, the spec's errors (Python and YAML), and the Polars, DuckDB, pipeline and semantic paths; on fake engines
whose answers carry a confidence, and once on two tiny random models."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.decoding.params import Completion
from helpers.fake_engine import FakeLLM
from helpers.skips import requires_smollm2
from helpers.tiny_tokenizer import build_tiny_tokenizer
from llmops import engines
from llmops.cascade import BINS, as_cascade, confidence_bins, escalates
from llmops.core import Job, MapSpec, last_summary, map_table_ordered
from llmops.duckdb import map_relation, register
from llmops.pipeline.load import PipelineError, load_pipeline
from llmops.pipeline.runner import run_pipeline
from llmops.polars import llm_map
from llmops.report_html import render_html
from llmops.semantic.polars import filter_frame
from llmops.validate import run_checked

LABELS = ["bug", "billing", "other"]
BODIES = ["a bug here", "unsure billing", None, "broken other", "billing ok", "unsure bug", "a bug here"]
SMALL, BIG = "small-model", "big-model"


class ScoredFake(FakeLLM):
    """A FakeLLM whose choice answers carry a confidence: `unsure` for rows whose text holds "unsure", else
    `sure`; with `breaks`, a row holding "broken" gets an answer that is none of the choices. It counts its
    plans (`planned`) and keeps the plan each call was given (`plans_given`)."""

    def __init__(self, name: str, *, sure: float, unsure: float, breaks: bool = False) -> None:
        super().__init__(fingerprint=name, block_size=2)
        self.sure, self.unsure, self.breaks = sure, unsure, breaks
        self.planned, self.plans_given, self.last_plan = 0, [], None

    def complete(self, prompt, params):
        c = super().complete(prompt, params)
        text = json.dumps(prompt)
        if params.choices is None or c.finish_reason != "stop":
            return c
        if self.breaks and "broken" in text:
            return Completion("none of them", [1], "stop", c.prompt_tokens, confidence=0.99)
        c.confidence = self.unsure if "unsure" in text else self.sure
        return c

    def plan(self, prompts, params, rows=None, measure=True):
        self.planned += 1
        return f"plan of {self.fingerprint} #{self.planned}"

    def stream(self, prompts, params=None, plan=None):
        self.plans_given.append(plan)
        self.last_plan = plan if plan is not None else self.plan(prompts, params)
        yield from super().stream(prompts, params)


@pytest.fixture
def fakes():
    """Engines for SMALL (unsure rows 0.5, others 0.95, "broken" rows answered wrong) and BIG (0.97 / 0.99),
    built by the operator layer's engine factory for this test."""
    made = {SMALL: ScoredFake(SMALL, sure=0.95, unsure=0.5, breaks=True), BIG: ScoredFake(BIG, sure=0.99, unsure=0.97)}
    previous = engines.set_factory(lambda model, **settings: made[model])
    yield made
    engines.set_factory(previous)


def _spec(**kw) -> MapSpec:
    return MapSpec("Label: {body}", choices=tuple(LABELS), cascade=(SMALL, BIG), **kw)


def _table() -> pa.Table:
    return pa.table({"body": BODIES})


def test_rows_escalate_exactly_when_unsure_or_invalid(fakes):
    out = map_table_ordered(_table(), _spec(min_confidence=0.9), cache_dir=False)
    assert out.column("model").to_pylist() == [SMALL, BIG, None, BIG, SMALL, BIG, SMALL]
    assert out.column("output").to_pylist() == ["bug", "billing", None, "other", "billing", "bug", "bug"]
    assert out.column("confidence").to_pylist() == [0.95, 0.97, None, 0.99, 0.95, 0.97, 0.95]
    assert fakes[SMALL].prompts_seen == 5 and fakes[BIG].prompts_seen == 3      # distinct non-null prompts
    s = last_summary()
    assert (s.rows, s.escalated, s.errors, s.nulls) == (7, 3, 0, 1)
    assert s.rows_by_model == {SMALL: 3, BIG: 3} and set(s.seconds_by_model) == {SMALL, BIG}
    assert s.confidence_bins == confidence_bins([0.95, 0.97, 0.99, 0.95, 0.97, 0.95])
    assert s.generated_rows == 8 and "escalated" in str(s)


def test_threshold_is_inclusive_and_optional(fakes):
    at = map_table_ordered(_table(), _spec(min_confidence=0.5), cache_dir=False)
    assert at.column("model").to_pylist() == [SMALL, SMALL, None, BIG, SMALL, SMALL, SMALL]   # only "broken"
    invalid_only = map_table_ordered(_table(), _spec(), cache_dir=False)
    assert invalid_only.column("model").to_pylist() == at.column("model").to_pylist()


def test_the_last_model_answers_for_good_even_when_unsure(fakes):
    out = map_table_ordered(_table(), _spec(min_confidence=0.98), cache_dir=False)
    assert out.column("model").to_pylist() == [BIG, BIG, None, BIG, BIG, BIG, BIG]
    assert out.column("confidence").to_pylist()[1] == 0.97            # below 0.98, but nothing comes after


def test_escalation_rule_on_output_batches():
    batch = pa.table({"output": ["a", None, "b", "c", None, "d"],
                      "finish_reason": ["stop", "error", "stop", "stop", None, "stop"],
                      "confidence": [0.95, None, 0.2, None, None, 0.99]})
    assert escalates(batch, 0.9) == [False, True, True, True, False, False]
    assert escalates(batch, None) == [False, True, False, False, False, False]
    flagged = [False, False, False, False, False, True]
    assert escalates(batch, None, flagged=flagged) == [False, True, False, False, False, True]


def test_one_job_per_model_each_planned_once(fakes):
    spec = _spec(min_confidence=0.9)
    job = Job(spec)
    first = map_table_ordered(_table().slice(0, 4), spec, job=job, cache_dir=False)
    second = map_table_ordered(pa.table({"body": ["unsure other", "fine bug"]}), spec, job=job, cache_dir=False)
    assert [s.spec.model for s in job.stages] == [SMALL, BIG]
    assert fakes[SMALL].planned == fakes[BIG].planned == 1
    assert fakes[SMALL].plans_given == [f"plan of {SMALL} #1"] * 2           # the job's plan, on every call
    assert fakes[BIG].plans_given == [f"plan of {BIG} #1"] * 2
    assert job.summary.calls == 2 and job.summary.rows == 6 and job.plan == f"plan of {SMALL} #1"
    assert first.column("model").to_pylist() == [SMALL, BIG, None, BIG]
    assert second.column("model").to_pylist() == [BIG, SMALL]


def test_rerun_is_served_from_the_cache_for_every_model(fakes, tmp_path):
    spec = _spec(min_confidence=0.9)
    first = map_table_ordered(_table(), spec, cache_dir=tmp_path)
    seen = {m: f.prompts_seen for m, f in fakes.items()}
    again = map_table_ordered(_table(), spec, cache_dir=tmp_path)
    assert {m: f.prompts_seen for m, f in fakes.items()} == seen
    assert again.equals(first)
    s = last_summary()
    assert s.cache_hits == 6 + 3 and s.generated_rows == 0 and s.rows_by_model == {SMALL: 3, BIG: 3}


@pytest.mark.parametrize("kwargs,message", [
    ({"cascade": (SMALL,)}, "at least two models"),
    ({"cascade": (SMALL, SMALL)}, "more than once"),
    ({"cascade": SMALL}, "list of at least two model names"),
    ({"cascade": (SMALL, "")}, r"cascade\[1\] must be a model name"),
    ({"min_confidence": 0.9}, "give cascade="),
    ({"cascade": (SMALL, BIG), "min_confidence": 1.5}, r"in \(0, 1\]"),
    ({"cascade": (SMALL, BIG), "min_confidence": True}, r"in \(0, 1\]"),
    ({"cascade": {"models": [SMALL, BIG], "threshold": 0.9}}, "unknown key"),
    ({"cascade": {"models": [SMALL, BIG], "min_confidence": 0.5}, "min_confidence": 0.9}, "given twice"),
])
def test_bad_cascade_specs_are_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MapSpec("Label: {body}", choices=tuple(LABELS), **kwargs)


def test_min_confidence_needs_a_constrained_output_and_no_engine():
    with pytest.raises(ValueError, match="free text carries no confidence"):
        MapSpec("Say {body}", cascade=(SMALL, BIG), min_confidence=0.9)
    spec = MapSpec("Say {body}", cascade={"models": [SMALL, BIG]})
    assert spec.model == SMALL and spec.cascade == (SMALL, BIG) and MapSpec.from_dict(spec.to_dict()) == spec
    assert as_cascade({"models": [SMALL, BIG], "min_confidence": 0.5}, constrained=True).min_confidence == 0.5
    with pytest.raises(ValueError, match=r"own engine: give engine as a mapping \{model: engine\}"):
        map_table_ordered(_table(), _spec(), engine=FakeLLM(), cache_dir=False)
    with pytest.raises(ValueError, match=r"\['other'\] that are not in the cascade"):
        map_table_ordered(_table(), _spec(), engine={SMALL: FakeLLM(), "other": FakeLLM()}, cache_dir=False)


def test_engines_given_per_model():
    small, big = ScoredFake(SMALL, sure=0.95, unsure=0.5), ScoredFake(BIG, sure=0.99, unsure=0.97)
    out = map_table_ordered(_table(), _spec(min_confidence=0.9), engine={SMALL: small, BIG: big}, cache_dir=False)
    assert out.column("model").to_pylist() == [SMALL, BIG, None, SMALL, SMALL, BIG, SMALL]
    assert (small.prompts_seen, big.prompts_seen) == (5, 2)


def test_polars_llm_map_with_meta_says_which_model_answered(fakes):
    df = pl.DataFrame({"body": BODIES})
    out = df.select(llm_map("Label: {body}", choices=LABELS, cascade=[SMALL, BIG], min_confidence=0.9,
                            with_meta=True, cache_dir=False).alias("m")).unnest("m")
    assert out["model"].to_list() == [SMALL, BIG, None, BIG, SMALL, BIG, SMALL]
    assert out.schema["confidence"] == pl.Float64 and out["confidence"][1] == 0.97
    assert out["output"].to_list() == ["bug", "billing", None, "other", "billing", "bug", "bug"]
    plain = df.select(llm_map("Label: {body}", choices=LABELS, cascade=[SMALL, BIG], cache_dir=False).alias("l"))
    assert plain["l"].to_list()[3] == "other"                                    # the broken row, from BIG


def test_duckdb_register_and_map_relation_take_the_cascade(fakes):
    con = duckdb.connect()
    con.execute("CREATE TABLE t AS SELECT * FROM (VALUES (1, 'a bug here'), (2, 'unsure billing'), "
                "(3, 'broken other')) v(id, body)")
    register(con, choices=LABELS, cascade=[SMALL, BIG], min_confidence=0.9, cache_dir=False)
    rows = con.execute("SELECT id, llm_map('Label: {body}', body) FROM t ORDER BY id").fetchall()
    assert rows == [(1, "bug"), (2, "billing"), (3, "other")]
    assert last_summary().rows_by_model == {SMALL: 1, BIG: 2}
    rel = map_relation(con, "SELECT * FROM t ORDER BY id", "Label: {body}", choices=LABELS, with_meta=True,
                       cascade=[SMALL, BIG], min_confidence=0.9, cache_dir=False)
    row = rel.fetchall()[1]
    assert row[:4] == (2, "unsure billing", "billing", "stop") and row[-2:] == (0.97, BIG)
    assert rel.columns[-2:] == ["confidence", "model"]


def test_validate_rules_escalate_like_invalid_outputs(fakes):
    spec = MapSpec("Label: {body}", choices=tuple(LABELS), cascade=(SMALL, BIG))
    table = pa.table({"body": ["a bug here", "billing ok"]})
    checked = run_checked(table, spec, rules=["label = 'bug'"], max_attempts=1, output_name="label", cache_dir=False)
    assert checked.table.column("model").to_pylist() == [SMALL, BIG]
    assert fakes[BIG].prompts_seen == 1                      # only the row whose answer broke the rule


YAML = """\
name: cascade
cache_dir: {cache}
source:
  csv: {data}
steps:
  - llm_map:
      output: label
      template: "Label: {{body}}"
      choices: [bug, billing, other]
      cascade: [{small}, {big}]
      min_confidence: 0.9
      model_column: answered_by
      confidence_column: sure
sink:
  parquet: {out}
"""


def _yaml(tmp_path: Path, **edits: str) -> Path:
    data = tmp_path / "tickets.csv"
    data.write_text("id,body\n" + "\n".join(f"{i},{b}" for i, b in enumerate(BODIES) if b) + "\n")
    text = YAML.format(cache=tmp_path / "cache", data=data, small=SMALL, big=BIG, out=tmp_path / "out.parquet")
    for old, new in edits.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


def test_pipeline_yaml_cascade_runs_and_reports_per_model(fakes, tmp_path):
    result = run_pipeline(load_pipeline(_yaml(tmp_path)), progress=False)
    out = pq.read_table(tmp_path / "out.parquet").to_pydict()
    assert out["answered_by"] == [SMALL, BIG, BIG, SMALL, BIG, SMALL]
    assert out["sure"] == [0.95, 0.97, 0.99, 0.95, 0.97, 0.95]
    report = json.loads(Path(result.report).read_text())
    step = report["llm_steps"][0]
    assert step["rows_by_model"] == {SMALL: 3, BIG: 3} and step["escalated"] == 3
    assert sum(step["confidence_bins"]) == 6 and len(step["confidence_bins"]) == BINS
    assert set(step["seconds_by_model"]) == {SMALL, BIG}
    page = render_html(report)
    assert "<h3>Models</h3>" in page and "plot-confidence" in page and BIG in page


@pytest.mark.parametrize("edit,needles", [
    ({f"cascade: [{SMALL}, {BIG}]": f"cascade: [{SMALL}]"}, ["p.yaml:10:", "steps[0].llm_map.cascade",
                                                           "at least two models"]),
    ({f"cascade: [{SMALL}, {BIG}]": f"cascade: {SMALL}"}, ["p.yaml:10:", "steps[0].llm_map.cascade"]),
    ({"min_confidence: 0.9": "min_confidence: 2"}, ["p.yaml:11:", "steps[0].llm_map.min_confidence", "(0, 1]"]),
    ({"min_confidence: 0.9": "min_confidence: true"}, ["p.yaml:11:", "steps[0].llm_map.min_confidence", "boolean"]),
    ({"      choices: [bug, billing, other]\n": ""}, ["p.yaml:10:", "steps[0].llm_map.min_confidence",
                                                     "free text carries no confidence"]),
    ({f"      cascade: [{SMALL}, {BIG}]\n": ""}, ["p.yaml:10:", "steps[0].llm_map.min_confidence", "give cascade"]),
    ({f"      cascade: [{SMALL}, {BIG}]\n": f"      model: {BIG}\n      cascade: [{SMALL}, {BIG}]\n"},
     ["p.yaml:11:", "steps[0].llm_map.cascade", "model or cascade, not both"]),
])
def test_bad_cascade_yaml_names_file_line_and_key(tmp_path, edit, needles):
    with pytest.raises(PipelineError) as info:
        load_pipeline(_yaml(tmp_path, **edit))
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in:\n{info.value}"


def test_semantic_filter_takes_a_cascade_mapping(fakes):
    df = pl.DataFrame({"body": ["Yes unsure", "No thanks", "Yes indeed"]})
    kept = filter_frame(df, "Keep? {body}", cascade={"models": [SMALL, BIG], "min_confidence": 0.9}, cache_dir=False)
    assert kept["body"].to_list() == ["Yes unsure", "Yes indeed"]
    assert fakes[BIG].prompts_seen == 1 and last_summary().rows_by_model == {SMALL: 2, BIG: 1}


# ---- two tiny random models, end to end through the engine's confidence

@pytest.fixture(scope="module")
def tiny_pair(tiny_llama, tiny_checkpoints, tmp_path_factory) -> tuple[str, str]:
    qwen = tmp_path_factory.mktemp("tiny_qwen2") / "qwen2"
    shutil.copytree(tiny_checkpoints["qwen2"], qwen)
    build_tiny_tokenizer(qwen)
    return str(tiny_llama), str(qwen)


@pytest.mark.parametrize("threshold,answered_by", [(1e-6, 0), (1.0, 1)])
def test_tiny_models_cascade_on_the_engines_confidence(tiny_pair, threshold, answered_by):
    settings = {"dtype": "float32", "device": "cpu", "policy": {"gpu_batch_size": 4, "num_gpu_batches": 1}}
    df = pl.DataFrame({"body": ["bug in the app", "billing question", None, "other thing"]})
    try:
        out = df.select(llm_map("Label: {body}", choices=LABELS, cascade=list(tiny_pair), min_confidence=threshold,
                                max_new_tokens=8, engine_settings=settings, with_meta=True, cache_dir=False)
                        .alias("m")).unnest("m")
    finally:
        engines.clear()
    assert out["model"].to_list() == [tiny_pair[answered_by]] * 2 + [None] + [tiny_pair[answered_by]]
    scores = [v for v in out["confidence"].to_list() if v is not None]
    assert len(scores) == 3 and all(0 < v < 1 for v in scores)
    assert set(out["output"].drop_nulls().to_list()) <= set(LABELS)


TICKETS = ["The app crashes when I press save", "I was charged twice this month", "What are your opening hours?",
           "Refund my last invoice please", "Error 500 on the login page", "Do you ship to Canada?"]


@requires_smollm2
@pytest.mark.slow
def test_smollm2_answers_the_rows_it_is_sure_of_and_a_tiny_model_the_rest(tiny_llama, tmp_path):
    settings = {"device": "cpu", "policy": {"gpu_batch_size": 8, "num_gpu_batches": 1}}
    template = "Classify this ticket as bug, billing or other: {body}"
    kw = dict(choices=LABELS, max_new_tokens=8, engine_settings=settings, with_meta=True, cache_dir=tmp_path)
    df = pl.DataFrame({"body": TICKETS})
    try:
        alone = df.select(llm_map(template, model="smollm2-135m-instruct", **kw).alias("m")).unnest("m")
        scores = alone["confidence"].to_list()
        threshold = sorted(scores)[len(scores) // 2]
        both = df.select(llm_map(template, cascade=["smollm2-135m-instruct", str(tiny_llama)],
                                 min_confidence=threshold, **kw).alias("m")).unnest("m")
    finally:
        engines.clear()
    assert all(0 < s <= 1 for s in scores) and alone["model"].to_list() == ["smollm2-135m-instruct"] * len(TICKETS)
    expected = ["smollm2-135m-instruct" if s >= threshold else str(tiny_llama) for s in scores]
    assert both["model"].to_list() == expected and len(set(expected)) == 2
    kept = [i for i, m in enumerate(expected) if m == "smollm2-135m-instruct"]
    assert [both["output"][i] for i in kept] == [alone["output"][i] for i in kept]
    assert last_summary().cache_hits == len(TICKETS)          # the first model's rows, from the plain run


FILTER_YAML = """\
name: keep
source:
  csv: {data}
steps:
  - llm_filter:
      template: "Keep? {{body}}"
      cascade: {cascade}
sink:
  parquet: {out}
"""


def _filter_yaml(tmp_path: Path, cascade: str) -> Path:
    data = tmp_path / "rows.csv"
    data.write_text("body\nYes unsure\nNo thanks\nYes indeed\n")
    path = tmp_path / "f.yaml"
    path.write_text(FILTER_YAML.format(data=data, cascade=cascade, out=tmp_path / "kept.parquet"))
    return path


def test_semantic_pipeline_step_takes_a_cascade(fakes, tmp_path):
    path = _filter_yaml(tmp_path, f"{{models: [{SMALL}, {BIG}], min_confidence: 0.9}}")
    result = run_pipeline(load_pipeline(path), use_cache=False, progress=False)
    assert pq.read_table(tmp_path / "kept.parquet").column("body").to_pylist() == ["Yes unsure", "Yes indeed"]
    assert result.llm_steps[0]["rows_by_model"] == {SMALL: 2, BIG: 1} and result.llm_steps[0]["escalated"] == 1


@pytest.mark.parametrize("cascade,needles", [
    (f"{{models: [{SMALL}], min_confidence: 0.9}}", ["f.yaml:7:", "steps[0].llm_filter.cascade", "at least two"]),
    (f"{{models: [{SMALL}, {BIG}], min_confidence: 0}}", ["f.yaml:7:", "steps[0].llm_filter.cascade", "(0, 1]"]),
    (f"{{models: [{SMALL}, {BIG}], threshold: 0.9}}", ["f.yaml:7:", "steps[0].llm_filter.cascade", "unknown key"]),
])
def test_bad_semantic_cascade_yaml_names_file_line_and_key(tmp_path, cascade, needles):
    with pytest.raises(PipelineError) as info:
        load_pipeline(_filter_yaml(tmp_path, cascade))
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in:\n{info.value}"
