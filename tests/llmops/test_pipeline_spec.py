"""Pipeline schema and YAML loading: errors name file/line/key, round-trips, env substitution, overrides."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helpers.paths import REPO
from llmops.pipeline.load import PipelineError, dump_pipeline, expected_keys, load_pipeline, parse_yaml
from llmops.pipeline.spec import LlmMapStep, Pipeline, SelectStep, duckdb_type

SAMPLE_PIPELINES = sorted((REPO / "pipelines").glob("*.yaml"))

BASE = """\
name: t
source:
  csv: in.csv
steps:
  - llm_map:
      output: label
      template: "Classify {body}"
      choices: [a, b]
sink:
  parquet: out.parquet
"""


def _load(tmp_path: Path, text: str, **kw) -> Pipeline:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return load_pipeline(path, **kw)


def _error(tmp_path: Path, text: str) -> str:
    with pytest.raises(PipelineError) as info:
        _load(tmp_path, text)
    return str(info.value)


BAD_CASES = [
    # (description, text transform, substrings the message must contain)
    ("unknown key in llm_map", lambda t: t.replace("      choices: [a, b]\n", "      choices: [a, b]\n      templat: x\n"),
     ["p.yaml:9:", "steps[0].llm_map.templat", "unknown key 'templat'", "expected one of:", "template"]),
    ("missing template", lambda t: t.replace('      template: "Classify {body}"\n', ""),
     ["p.yaml:5:", "steps[0].llm_map.template", "missing required key 'template'"]),
    ("wrong type", lambda t: t.replace("choices: [a, b]", "choices: [a, b]\n      max_new_tokens: ten"),
     ["p.yaml:9:", "steps[0].llm_map.max_new_tokens", "valid integer", "'ten'"]),
    ("unknown step", lambda t: t.replace("  - llm_map:", "  - llm_mapp:"),
     ["p.yaml:5:", "steps[0]", "one of: sql, llm_map, filter, dedupe, parse, select", "llm_mapp"]),
    ("unknown top-level key", lambda t: t + "sinks: {}\n",
     ["p.yaml:11:", "sinks", "unknown key 'sinks'", "source", "steps"]),
    ("two source kinds", lambda t: t.replace("  csv: in.csv\n", "  csv: in.csv\n  parquet: in.parquet\n"),
     ["p.yaml:2:", "source", "exactly one of csv, parquet, jsonl, query, table", "got csv, parquet"]),
    ("missing sink", lambda t: t[: t.index("sink:")],
     ["sink", "missing required key 'sink'"]),
    ("bad parse type", lambda t: t.replace("sink:", "  - parse: {x: dat}\nsink:"),
     ["p.yaml:9:", "steps[1].parse.x", "unknown type 'dat'", "decimal(p,s)"]),
    ("schema and choices", lambda t: t.replace("choices: [a, b]", "choices: [a, b]\n      schema: {x: string}"),
     ["p.yaml:5:", "steps[0].llm_map", "at most one of schema, choices, regex"]),
    ("example not a choice", lambda t: t.replace("choices: [a, b]",
                                                 "choices: [a, b]\n      examples: [{input: {body: x}, output: c}]"),
     ["steps[0].llm_map", "examples[0].output 'c' is not one of choices"]),
    ("sink table without database", lambda t: t.replace("  parquet: out.parquet", "  parquet: o.parquet\n  table: t"),
     ["p.yaml:9:", "sink", "sink.table goes with sink.database"]),
    ("unset env var", lambda t: t.replace("csv: in.csv", "csv: ${LLMOPS_TEST_SURELY_UNSET}/in.csv"),
     ["p.yaml:3:", "source.csv", "LLMOPS_TEST_SURELY_UNSET is not set"]),
]


@pytest.mark.parametrize("name,transform,needles", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_pipelines_name_line_key_and_expectation(tmp_path, name, transform, needles):
    message = _error(tmp_path, transform(BASE))
    for needle in needles:
        assert needle in message, f"{needle!r} not in:\n{message}"


def test_yaml_syntax_error_has_line_and_column(tmp_path):
    message = _error(tmp_path, "source:\n  csv: [a, b\nsink: {parquet: x}\n")
    assert "p.yaml:3:" in message and "YAML syntax error" in message


def test_duplicate_key_is_an_error(tmp_path):
    message = _error(tmp_path, BASE + "source: {csv: other.csv}\n")
    assert "duplicate key 'source' (first at line 2)" in message and "p.yaml:11" in message


def test_non_mapping_and_missing_file(tmp_path):
    assert "a pipeline is a mapping" in _error(tmp_path, "- just\n- a list\n")
    with pytest.raises(PipelineError, match="cannot read pipeline file"):
        load_pipeline(tmp_path / "nope.yaml")


def test_all_errors_reported_sorted_by_line(tmp_path):
    text = BASE.replace("csv: in.csv", "csv: 3\n  bogus: 1").replace("choices: [a, b]", "choices: [a, b]\n      foo: 1")
    problems = pytest.raises(PipelineError, _load, tmp_path, text).value.problems
    lines = [int(p.split(":")[1]) for p in problems]
    assert len(problems) == 3 and lines == sorted(lines) == [3, 4, 10]


def test_parse_yaml_records_lines():
    data = parse_yaml("a: 1\nb:\n  - x\n  - y: 2\n")
    assert data.key_lines == {"a": 1, "b": 2}
    assert data["b"].item_lines == [3, 4] and data["b"][1].key_lines == {"y": 4}


def test_expected_keys_walks_unions_and_lists():
    assert "template" in expected_keys(Pipeline, ("steps", 0, "llm_map", "llm_map"))
    assert expected_keys(Pipeline, ("source",)) == sorted(["csv", "parquet", "jsonl", "query", "table",
                                                           "database", "limit"])
    assert expected_keys(Pipeline, ("nope",)) is None


@pytest.mark.parametrize("path", SAMPLE_PIPELINES, ids=[p.stem for p in SAMPLE_PIPELINES])
def test_sample_pipelines_round_trip(path, tmp_path):
    pipeline = load_pipeline(path)
    assert Pipeline.from_dict(pipeline.to_dict()) == pipeline
    dumped = tmp_path / "again.yaml"
    dumped.write_text(dump_pipeline(pipeline))
    assert load_pipeline(dumped) == pipeline
    assert pipeline.llm_steps and pipeline.llm_steps[0].max_new_tokens <= 72


def test_sample_pipelines_are_the_four_tasks():
    assert {p.stem for p in SAMPLE_PIPELINES} >= {"extract_invoices", "clean_customers", "match_products",
                                                  "classify_tickets"}


def test_round_trip_every_step_kind():
    data = {
        "name": "all", "model": "tiny", "engine": {"gpu_memory": "16GiB", "compress_weights": True},
        "cache_dir": False,
        "source": {"query": "SELECT 1 AS a", "database": "db.duckdb"},
        "steps": [{"sql": "SELECT * FROM input"}, {"filter": "a > 0"}, {"dedupe": ["a"]},
                  {"parse": {"a": "decimal(10,2)"}}, {"select": {"b": "a"}},
                  {"llm_map": {"output": "o", "template": "{b}", "schema": {"x": "number"}, "unnest": "p_",
                               "examples": [{"input": {"b": 1}, "output": {"x": 1.5}}], "stop": ["\n"]}}],
        "sink": {"database": "db.duckdb", "table": "t", "mode": "append"},
    }
    pipeline = Pipeline.from_dict(data)
    again = Pipeline.from_dict(yaml.safe_load(yaml.safe_dump(pipeline.to_dict())))
    assert again == pipeline
    assert [type(s).__name__ for s in pipeline.steps][-2:] == ["SelectStep", "LlmMapStep"]
    assert pipeline.engine.llm_kwargs() == {"gpu_memory": "16GiB", "compress_weights": True}


def test_schema_shorthand_becomes_strict_json_schema():
    step = Pipeline.from_dict(yaml.safe_load(BASE.replace("choices: [a, b]", "schema: {n: integer, s: {type: string}}")))
    schema = step.steps[0].llm_map.schema_
    assert schema == {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
                      "required": ["n", "s"], "additionalProperties": False}
    full = {"type": "object", "properties": {"a": {"type": "string"}}}
    again = Pipeline.from_dict(yaml.safe_load(BASE.replace("choices: [a, b]", f"schema: {full}")))
    assert again.steps[0].llm_map.schema_ == full


def test_env_substitution_in_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPS_TEST_DATA", "/data")
    text = BASE.replace("csv: in.csv", "csv: ${LLMOPS_TEST_DATA}/in.csv").replace(
        "parquet: out.parquet", "parquet: ${LLMOPS_TEST_OUT:-out}/x.parquet")
    pipeline = _load(tmp_path, text)
    assert pipeline.source.csv == "/data/in.csv" and pipeline.sink.parquet == "out/x.parquet"
    assert "${" in _load(tmp_path, BASE.replace("Classify {body}", "Cost ${x} {body}")).steps[0].llm_map.template


def test_overrides(tmp_path):
    pipeline = _load(tmp_path, BASE, overrides=["engine.gpu_memory=24GiB", "steps.0.llm_map.max_new_tokens=3",
                                                "model=big-model"])
    assert pipeline.engine.gpu_memory == "24GiB" and pipeline.model == "big-model"
    assert pipeline.steps[0].llm_map.max_new_tokens == 3
    with pytest.raises(PipelineError, match="expected KEY.PATH=VALUE"):
        _load(tmp_path, BASE, overrides=["nonsense"])
    with pytest.raises(PipelineError, match="has no item '5'"):
        _load(tmp_path, BASE, overrides=["steps.5.sql=x"])


def test_duckdb_type_names():
    assert duckdb_type("Float") == "DOUBLE" and duckdb_type("decimal(12, 2)") == "DECIMAL(12,2)"
    with pytest.raises(ValueError, match="unknown type"):
        duckdb_type("datez")


def test_step_models_are_typed():
    pipeline = Pipeline.from_dict(yaml.safe_load(BASE.replace("sink:", "  - select: [a]\nsink:")))
    assert isinstance(pipeline.steps[0], LlmMapStep) and isinstance(pipeline.steps[1], SelectStep)


def test_engine_devices(tmp_path):
    """`engine.devices` / `engine.parallel` reach `LLM(...)`'s keywords; a list becomes a hashable setting."""
    from llmops.core import MapSpec

    pipeline = _load(tmp_path, "engine: {devices: [0, 1], parallel: pipeline}\n" + BASE)
    kwargs = pipeline.engine.llm_kwargs()
    assert kwargs == {"devices": [0, 1], "parallel": "pipeline"}
    spec = MapSpec("Classify {body}", engine=kwargs)
    assert dict(spec.engine)["devices"] == (0, 1) and hash(spec) == hash(MapSpec("Classify {body}", engine=kwargs))
    assert _load(tmp_path, "engine: {devices: auto}\n" + BASE).engine.llm_kwargs() == {"devices": "auto"}
    message = _error(tmp_path, "engine: {devices: [0, true]}\n" + BASE)
    assert "p.yaml:1:" in message and "engine.devices" in message
    assert "engine.parallel" in _error(tmp_path, "engine: {parallel: tensor}\n" + BASE)


def test_engine_policy_pins_a_plan(tmp_path):
    """`engine.policy` is "auto" or a mapping of Policy fields (what `llmops policy --json` prints under
    "policy"): it reaches `LLM(...)` as a Policy, hashable, round-tripping through MapSpec's dict; an unknown
    field, an invalid value or another string is an error naming `engine.policy`, with the file and line."""
    from engine import Policy
    from llmops.core import MapSpec

    text = "engine:\n  policy: {gpu_batch_size: 64, num_gpu_batches: 2, prefill_ahead: true}\n" + BASE
    kwargs = _load(tmp_path, text).engine.llm_kwargs()
    spec = MapSpec("Classify {body}", engine=kwargs)
    policy = dict(spec.engine)["policy"]
    assert isinstance(policy, Policy) and (policy.gpu_batch_size, policy.num_gpu_batches) == (64, 2)
    assert policy.prefill_ahead and MapSpec.from_dict(spec.to_dict()) == spec
    assert hash(spec) == hash(MapSpec("Classify {body}", engine={"policy": policy.to_dict()}))
    for bad, says in (("{gpu_batchsize: 64}", "unknown field(s) ['gpu_batchsize']"),
                      ("{w_gpu: 2.0}", "w_gpu must be in [0, 1]"), ("fast", "auto")):
        message = _error(tmp_path, f"engine:\n  policy: {bad}\n" + BASE)
        assert "p.yaml:2:" in message and "engine.policy" in message and says in message, message
    with pytest.raises(ValueError, match="engine.policy: expected 'auto'"):
        MapSpec("Classify {body}", engine={"policy": "fast"})
