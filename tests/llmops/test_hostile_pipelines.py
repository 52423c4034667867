"""Hostile pipeline files: every error comes before the first generated row, names the file and line (or the
step), and exits 2 (or 1 for a sink that cannot be written); nothing is generated and no sink is touched."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers.fake_engine import FakeLLM
from llmops import engines
from llmops.cli import main
from llmops.pipeline.load import PipelineError, load_pipeline

PIPELINE = """\
source: {{csv: {data}}}
engine: {{device: cpu}}
cache_dir: false
steps:
  - llm_map:
      output: first
      template: "Say {{b}}"
  - {step}
sink: {{{sink}: {out}}}
"""
SECOND = 'llm_map: {{output: second, template: "{template}"}}'

# (case, the second step, the file's own line or None (a step error), what the error says)
AT_LOAD = [
    ("reserved output column", 'llm_map: {output: __llmops_row, template: "x {b}"}', 8,
     "column name '__llmops_row' is reserved"),
    ("reserved error column", 'llm_map: {output: o, template: "x {b}", error_column: __llmops_err}', 8,
     "column name '__llmops_err' is reserved"),
    ("unnest field twice", 'llm_map: {output: o, template: "x {b}", schema: {a: string}, unnest: true, '
                           'error_column: a}', 8, "writes column(s) ['a'] twice"),
    ("attribute placeholder", SECOND.format(template="{a.__class__}"), 8, "must be a bare column name"),
    ("unbalanced braces", SECOND.format(template="{b"), 8, "malformed template"),
    ("smuggled validate rule", 'llm_map: {output: o, template: "x {b}", validate: "true) AS ok, (false"}', 8,
     "is not one DuckDB expression"),
    ("rule with two statements", 'llm_map: {output: o, template: "x {b}", validate: "true; DROP TABLE input"}', 8,
     "is not a DuckDB expression"),
    ("repeated choices", 'llm_map: {output: o, template: "x {b}", choices: [a, a]}', 8, "'a' is given twice"),
    ("NaN temperature", 'llm_map: {output: o, template: "x {b}", temperature: .nan}', 8, "finite number"),
    ("infinite top_p", 'llm_map: {output: o, template: "x {b}", top_p: .inf}', 8, "finite number"),
    ("dangling $ref", 'llm_map: {output: o, template: "x {b}", schema: {type: object, properties: '
                      '{a: {"$ref": "#/definitions/gone"}}}}', 8, "points at nothing"),
]


def _write(tmp: Path, step: str, *, sink: str = "parquet", out: str | None = None, engine: str = "{device: cpu}",
           data: str = "b,total\nx,1\ny,2\n") -> Path:
    (tmp / "d.csv").write_text(data)
    path = tmp / "p.yaml"
    text = PIPELINE.format(data=tmp / "d.csv", step=step, sink=sink, out=out or tmp / "o.parquet")
    path.write_text(text.replace("engine: {device: cpu}", f"engine: {engine}"))
    return path


def _run(path: Path) -> tuple[object, FakeLLM]:
    eng = FakeLLM()
    previous = engines.set_factory(lambda model, **s: eng)
    try:
        return CliRunner().invoke(main, ["run", str(path)]), eng
    finally:
        engines.set_factory(previous)


@pytest.mark.parametrize("case, step, line, message", AT_LOAD, ids=[c[0] for c in AT_LOAD])
def test_problems_found_at_load_exit_2_with_file_and_line(case, step, line, message, tmp_path):
    path = _write(tmp_path, step)
    with pytest.raises(PipelineError) as info:
        load_pipeline(path)
    assert f"{path}:{line}: " in str(info.value) and message in str(info.value), str(info.value)
    result, eng = _run(path)
    assert result.exit_code == 2 and f"{path}:{line}:" in result.stderr and "Traceback" not in result.output
    assert eng.calls == 0 and not (tmp_path / "o.parquet").exists()


ENGINE_SETTINGS = [
    ("{dtype: float13}", "engine.dtype: unknown dtype 'float13'"),
    ("{device: tpu}", "engine.device: unknown device 'tpu'"),
    ("{gpu_memory: lots}", "engine.gpu_memory: cannot parse size 'lots'"),
    ("{cpu_memory: -5}", "engine.cpu_memory: size must be >= 0"),
    ("{devices: [-1]}", "engine.devices: devices[0]: expected a CUDA index"),
]


@pytest.mark.parametrize("engine, message", ENGINE_SETTINGS, ids=[e[0] for e in ENGINE_SETTINGS])
def test_engine_settings_are_checked_at_load(engine, message, tmp_path):
    path = _write(tmp_path, SECOND.format(template="x {b}"), engine=engine)
    result, eng = _run(path)
    assert result.exit_code == 2 and f"{path}:2: {message}" in result.stderr, result.stderr
    assert eng.calls == 0 and "Traceback" not in result.output


# (case, the second step, source data, what the error says): found against the data's columns, before any work
BEFORE_WORK = [
    ("unknown column in the second template", SECOND.format(template="{nonexistent}"), None,
     "steps[1] (llm_map): template '{nonexistent}' uses 'nonexistent'"),
    ("unnested field over an input column", 'llm_map: {output: o, template: "x {b}", schema: {total: number}, '
                                            'unnest: true}', None, "unnested field(s) ['total'] would overwrite"),
    ("rule on an unknown column", 'llm_map: {output: o, template: "x {b}", validate: "nope > 0"}', None,
     "steps[1] (llm_map): validate rules ['nope > 0']"),
    ("SQL on an unknown column", "filter: missing_column > 1", None, "steps[1] (filter)"),
    ("a reserved source column", "filter: total > 0", "b,__llmops_row\nx,1\n", "source.csv: column(s) ['__llmops_row']"),
]


@pytest.mark.parametrize("case, step, data, message", BEFORE_WORK, ids=[c[0] for c in BEFORE_WORK])
def test_problems_with_the_data_fail_before_the_first_step_runs(case, step, data, message, tmp_path):
    path = _write(tmp_path, step, **({"data": data} if data else {}))
    load_pipeline(path)
    result, eng = _run(path)
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.output
    assert eng.calls == 0 and not (tmp_path / "o.parquet").exists()


def test_a_sink_that_is_a_directory_is_refused_at_load(tmp_path):
    (tmp_path / "out_dir").mkdir()
    path = _write(tmp_path, SECOND.format(template="x {b}"), out=str(tmp_path / "out_dir"))
    result, eng = _run(path)
    assert result.exit_code == 2 and f"{path}:9: sink.parquet: {tmp_path / 'out_dir'} is a directory" in result.stderr
    assert eng.calls == 0


@pytest.mark.parametrize("where", ["under_a_file", "/sys/llmops-sink"])
def test_a_sink_folder_that_cannot_be_written_fails_before_any_work(where, tmp_path):
    (tmp_path / "under_a_file").write_text("a file\n")
    folder = Path(where) if where.startswith("/") else tmp_path / where
    path = _write(tmp_path, SECOND.format(template="x {b}"), out=str(folder / "o.parquet"))
    result, eng = _run(path)
    assert result.exit_code == 1 and f"sink: cannot write in folder {folder}" in result.stderr, result.stderr
    assert eng.calls == 0 and "Traceback" not in result.output


def test_a_good_two_step_pipeline_still_runs(tmp_path):
    path = _write(tmp_path, SECOND.format(template="x {first}"))
    result, eng = _run(path)
    assert result.exit_code == 0, result.output
    assert eng.prompts_seen == 4
