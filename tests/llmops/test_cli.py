"""The `llmops` CLI through click's runner, on the fake engine: each command, its errors and exit codes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from helpers.fake_engine import FakeLLM
from llmops import engines
from llmops.cli import main

PIPELINE = """\
name: cli
cache_dir: {cache}
source:
  csv: {data}
steps:
  - llm_map:
      output: category
      template: "Classify: {{body}}"
      choices: [bug, billing, other]
  - select: [id, category]
sink:
  parquet: {out}
"""


@pytest.fixture
def fake(monkeypatch) -> FakeLLM:
    """Every engine the CLI asks for is this fake (the engine cache is restored afterwards)."""
    engine = FakeLLM(block_size=2)
    previous = engines.set_factory(lambda model, **settings: engine)
    yield engine
    engines.set_factory(previous)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    data = tmp_path / "t.csv"
    data.write_text("id,body\n1,a bug here\n2,billing please\n3,CUT me\n4,hello\n")
    pipe = tmp_path / "p.yaml"
    pipe.write_text(PIPELINE.format(cache=tmp_path / "cache", data=data, out=tmp_path / "out.parquet"))
    return {"data": data, "pipeline": pipe, "out": tmp_path / "out.parquet", "dir": tmp_path}


def _run(*args: str, input: str | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def test_run_ok_prints_summary(fake, files):
    result = _run("run", files["pipeline"])
    assert result.exit_code == 0, result.output
    assert "4 rows read, 4 written to" in result.stdout and "cache hits" in result.stdout
    assert pq.read_table(files["out"]).to_pydict()["category"][:2] == ["bug", "billing"]
    again = _run("run", files["pipeline"], "--json")
    summary = json.loads(again.stdout)
    assert again.exit_code == 0 and summary["cache_hits"] == 4 and summary["rows_written"] == 4


def test_run_bad_yaml_exits_2_with_file_line_key(fake, files):
    files["pipeline"].write_text(files["pipeline"].read_text().replace("      choices:", "      choice:"))
    result = _run("run", files["pipeline"])
    assert result.exit_code == 2
    assert f"{files['pipeline']}:9: steps[0].llm_map.choice: unknown key 'choice'" in result.stderr
    assert fake.calls == 0


def test_run_invalid_inputs_exit_2(fake, files):
    assert _run("run", files["dir"] / "missing.yaml").exit_code == 2
    files["pipeline"].write_text(files["pipeline"].read_text().replace("{body}", "{text}"))
    result = _run("run", files["pipeline"])
    assert result.exit_code == 2 and "'text'" in result.stderr and "available columns: id, body" in result.stderr
    files["data"].unlink()
    result = _run("run", files["pipeline"])
    assert result.exit_code == 2 and "file not found" in result.stderr


def test_run_failed_rows_exit_1_unless_allowed(fake, files):
    text = files["pipeline"].read_text().replace("choices: [bug, billing, other]", "schema: {n: integer}")
    files["pipeline"].write_text(text.replace("[id, category]", "[id, category]\n"))
    result = _run("run", files["pipeline"])
    assert result.exit_code == 1 and "1 row(s) failed" in result.stderr
    assert _run("run", files["pipeline"], "--allow-errors").exit_code == 0


def test_run_engine_crash_exits_1_with_message(files):
    previous = engines.set_factory(lambda model, **s: FakeLLM(fail_at_block=0))
    try:
        result = _run("run", files["pipeline"])
    finally:
        engines.set_factory(previous)
    assert result.exit_code == 1 and "RuntimeError: fake engine crashed at block 0" in result.stderr
    assert not files["out"].exists()


def test_dry_run_generates_nothing(fake, files):
    result = _run("run", files["pipeline"], "--dry-run", "--limit", "2")
    assert result.exit_code == 0, result.output
    assert fake.calls == 0 and fake.prompts_seen == 0 and not files["out"].exists()
    assert "Classify: a bug here" in result.stdout and "policy: auto" in result.stdout
    plan = json.loads(_run("run", files["pipeline"], "--dry-run", "--json").stdout)
    assert plan["steps"][0]["kind"] == "llm_map" and fake.calls == 0


def test_run_limit_set_and_model_overrides(fake, files, monkeypatch):
    seen: list[tuple[str, dict]] = []
    previous = engines.set_factory(lambda model, **s: seen.append((model, s)) or fake)
    try:
        result = _run("run", files["pipeline"], "--limit", "2", "--model", "other-model",
                      "--set", "engine.gpu_memory=1GiB", "--no-cache")
    finally:
        engines.set_factory(previous)
    assert result.exit_code == 0, result.output
    assert seen == [("other-model", {"gpu_memory": "1GiB"})]
    assert pq.read_table(files["out"]).num_rows == 2


def test_runner_ray_without_ray_installed_says_how_to_get_it(fake, files, monkeypatch):
    for name in ("ray", "ray.data", "llmops.ray", "llmops.pipeline.ray_runner"):
        monkeypatch.setitem(sys.modules, name, None)       # `import ray` raises ImportError
    result = _run("run", files["pipeline"], "--runner", "ray")
    assert result.exit_code == 2 and 'pip install "llmops-engine[ray]"' in result.stderr and fake.calls == 0


def test_generate_lines_from_stdin(fake):
    result = _run("generate", "--max-new-tokens", "3", "--no-cache", input="hello there world\n\nsecond line\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["echo: hello there", "echo: second line"]


def test_generate_csv_with_template_choices_and_jsonl(fake, files):
    result = _run("generate", files["data"], "-t", "Classify: {body}", "--choices", "bug,billing,other", "--jsonl",
                  "--no-cache")
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert result.exit_code == 0 and [r["output"] for r in rows[:2]] == ["bug", "billing"] and len(rows) == 4


def test_generate_output_file_and_errors(fake, files):
    out = files["dir"] / "gen.parquet"
    result = _run("generate", files["data"], "-t", "{body}", "--schema", '{"n": "integer"}', "-o", out, "--no-cache")
    assert result.exit_code == 1 and "1 row(s) failed" in result.stderr  # the CUT row
    table = pq.read_table(out)
    assert table.column_names == ["id", "body", "output"] and table.num_rows == 4
    missing = _run("generate", files["data"])
    assert missing.exit_code == 2 and "--template" in missing.stderr
    bad = _run("generate", files["data"], "-t", "{nope}")
    assert bad.exit_code == 2 and "nope" in bad.stderr
    assert _run("generate", files["data"], "-t", "{body}", "--schema", "{oops").exit_code == 2


def test_models_lists_aliases_and_presets(files):
    result = _run("models", "--json")
    assert result.exit_code == 0, result.output
    names = {row["name"] for row in json.loads(result.stdout)}
    assert {"smollm2-135m-instruct", "opt-30b", "mixtral-8x7b"} <= names
    folder = files["dir"] / "models"
    (folder / "my-llama").mkdir(parents=True)
    (folder / "my-llama" / "config.json").write_text("{}")
    table = _run("models", "--dir", folder).stdout
    assert "NAME" in table.splitlines()[0] and "my-llama" in table and "mixtral-8x7b" in table


@pytest.mark.parametrize("command", [["--help"], ["run", "--help"], ["generate", "--help"], ["models", "--help"],
                                     ["policy", "--help"], ["profile", "--help"]])
def test_every_command_has_help_with_an_example(command):
    result = _run(*command)
    assert result.exit_code == 0 and "xample" in result.stdout and "llmops" in result.stdout


def test_generate_tables_on_stdin_with_id_and_limit(fake, files):
    csv_text = files["data"].read_text()
    result = _run("generate", "-t", "Classify: {body}", "--choices", "bug,billing,other", "--jsonl", "--id", "id",
                  "--no-cache", input=csv_text)
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert result.exit_code == 0, result.output
    assert [r["id"] for r in rows] == [1, 2, 3, 4] and rows[0]["output"] == "bug"
    jsonl = "".join(json.dumps({"key": f"k{i}", "body": f"text {i}"}) + "\n" for i in range(5))
    piped = _run("generate", "-t", "{body}", "--jsonl", "--id", "key", "--limit", "3", "--no-cache", input=jsonl)
    assert piped.exit_code == 0, piped.output
    assert [json.loads(line)["key"] for line in piped.stdout.splitlines()] == ["k0", "k1", "k2"]
    prompts = _run("generate", "--jsonl", "--no-cache", input='{"prompt": "hi there"}\n')   # {prompt} by default
    assert prompts.exit_code == 0 and json.loads(prompts.stdout)["output"] == "echo: hi there"
    text = _run("generate", "--limit", "1", "--no-cache", input="one\ntwo\n")
    assert text.exit_code == 0 and text.stdout.splitlines() == ["echo: one"]


def test_generate_parquet_stdin_regex_and_errors(fake, files):
    import pyarrow as pa
    import pyarrow.parquet as pq_

    path = files["dir"] / "in.parquet"
    pq_.write_table(pa.table({"id": [7, 8], "body": ["a", "b"]}), path)
    result = CliRunner().invoke(main, ["generate", "-t", "{body}", "--jsonl", "--id", "id", "--no-cache"],
                                input=path.read_bytes())
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["id"] for line in result.stdout.splitlines()] == [7, 8]
    regex = _run("generate", files["data"], "-t", "{body}", "--regex", "[a-z]+", "--no-cache", "--limit", "1")
    assert regex.exit_code == 0 and fake.last_params.regex == "[a-z]+"
    assert _run("generate", files["data"], "-t", "{body}", "--regex", "(?=x)").exit_code == 2
    both = _run("generate", files["data"], "-t", "{body}", "--regex", "a", "--choices", "a,b")
    assert both.exit_code == 2 and "at most one" in both.stderr
    bad_id = _run("generate", files["data"], "-t", "{body}", "--id", "nope")
    assert bad_id.exit_code == 2 and "available columns: id, body" in bad_id.stderr
    batch = files["dir"] / "req.jsonl"
    batch.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"messages": [{"role": "user", "content": "x"}]}}) + "\n")
    hint = _run("generate", batch)
    assert hint.exit_code == 2 and "llmops batch" in hint.stderr
