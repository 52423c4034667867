"""CLI conventions through click's runner on the fake engine: --version, -v/-q and logging, --set
validation, `llmops models` capabilities, hints on the main help's examples."""
from __future__ import annotations

import logging
from importlib import metadata
from pathlib import Path

from click.testing import CliRunner

import llmops
from helpers.paths import REPO
from llmops.cli import main


def _run(*args: str, input: str | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def test_version_matches_the_package_metadata():
    result = _run("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"llmops {llmops.__version__}"
    assert _run("-V").stdout == result.stdout
    assert metadata.version(llmops.DISTRIBUTION) == llmops.__version__
    text = (REPO / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in text and (REPO / "LICENSE").exists()


def test_verbose_and_quiet_set_logging_and_diagnostics(fake):
    result = _run("-q", "generate", "--no-cache", input="hello\n")
    assert result.exit_code == 0 and result.stdout == "echo: hello\n" and result.stderr == ""
    assert logging.getLogger("llmops").level == logging.ERROR
    loud = _run("generate", "--no-cache", input="hello\n")
    assert "rows in" in loud.stderr and logging.getLogger("llmops").level == logging.WARNING
    _run("-v", "generate", "--no-cache", input="hello\n")
    assert logging.getLogger("llmops").level == logging.INFO and logging.getLogger("engine").level == logging.INFO
    _run("-vv", "generate", "--no-cache", input="hello\n")
    assert logging.getLogger("llmops").level == logging.DEBUG
    assert logging.getLogger().level == logging.WARNING        # other libraries' loggers stay quiet
    assert _run("-q", "generate", "nope.txt").exit_code == 2    # errors still reach stderr under -q
    assert "nope.txt" in _run("-q", "generate", "nope.txt").stderr


PIPE = """\
cache_dir: {cache}
source:
  csv: {data}
steps:
  - llm_map:
      output: c
      template: "Classify: {{{column}}}"
sink:
  parquet: {out}
"""


def _pipeline(tmp_path: Path, *, column: str = "body", data: str | None = None) -> Path:
    csv = tmp_path / "t.csv"
    csv.write_text("id,body\n1,a bug\n")
    pipe = tmp_path / "p.yaml"
    pipe.write_text(PIPE.format(cache=tmp_path / "cache", data=data or csv, out=tmp_path / "o.parquet", column=column))
    return pipe


def test_set_is_validated_like_the_file(fake, tmp_path):
    pipe = _pipeline(tmp_path)
    result = _run("run", pipe, "--set", "engine.gpu_memry=24GiB")
    assert result.exit_code == 2 and "KeyError" not in result.stderr
    assert "--set engine.gpu_memry=24GiB" in result.stderr and "'gpu_memry'" in result.stderr
    assert "gpu_memory" in result.stderr and "cpu_memory" in result.stderr           # the known keys
    step = _run("run", pipe, "--set", "steps.0.llm_map.max_new_tokenz=3")
    assert step.exit_code == 2 and "--set steps.0.llm_map.max_new_tokenz=3" in step.stderr
    assert "max_new_tokens" in step.stderr
    assert _run("run", pipe, "--set", "engine.gpu_memory=24GiB", "--dry-run").exit_code == 0


def test_template_and_source_errors_name_file_and_line(fake, tmp_path):
    bad_column = _pipeline(tmp_path, column="bodyy")
    result = _run("run", bad_column)
    assert result.exit_code == 2 and f"{bad_column}:7: steps[0] (llm_map): template" in result.stderr
    assert f"{bad_column}:7:" in _run("run", bad_column, "--dry-run").stderr
    missing = _pipeline(tmp_path, data=str(tmp_path / "nope.csv"))
    result = _run("run", missing)
    assert result.exit_code == 2 and f"{missing}:3: source.csv: file not found" in result.stderr


def test_models_say_what_each_entry_can_do(fake):
    rows = __import__("json").loads(_run("models", "--json").stdout)
    uses = {r["name"]: r["uses"] for r in rows}
    assert uses["smollm2-135m-instruct"] == "generate" and uses["opt-6.7b"] == "benchmark"
    table = _run("models").stdout.splitlines()
    assert "USE" in table[0] and any(line.startswith("opt-6.7b") and "benchmark" in line for line in table)
    result = _run("generate", "-m", "opt-6.7b", input="hi\n")
    assert result.exit_code == 2 and "benchmark-only preset" in result.stderr and fake.calls == 0
    assert _run("batch", "-", "-m", "opt-6.7b", input="").exit_code == 2


def test_main_help_policy_example_works_and_a_no_fit_gives_a_hint():
    helptext = _run("--help").stdout
    example = next(line for line in helptext.splitlines() if "llmops policy" in line).split("#")[0].split()
    assert example[:2] == ["llmops", "policy"]
    assert _run(*example[1:], "--hardware", "h200").exit_code == 0
    tight = _run("policy", "--model", "mixtral-8x7b", "--gpu-memory", "24GiB", "--hardware", "h200")
    assert tight.exit_code == 2 and "hint: try --cpu-memory 128GiB" in tight.stderr
    assert "--allow-compression" in tight.stderr
    suggested = _run("policy", "--model", "mixtral-8x7b", "--gpu-memory", "24GiB", "--cpu-memory", "128GiB",
                     "--hardware", "h200")
    assert suggested.exit_code == 0


def test_dry_run_prints_the_estimate_and_generates_nothing(fake, tmp_path):
    csv = tmp_path / "five.csv"
    csv.write_text("id,body\n1,a bug\n2,billing\n3,a bug\n4,\n5,other\n")
    pipe = _pipeline(tmp_path, data=str(csv))
    plan = __import__("json").loads(_run("run", pipe, "--dry-run", "--json").stdout)
    est = plan["steps"][0]["estimate"]
    assert fake.prompts_seen == 0
    assert (est["rows"], est["null_rows"], est["deduped_rows"], est["cached_rows"], est["rows_to_generate"]) == \
        (5, 1, 1, 0, 3)
    assert est["prompt_tokens"] > 0 and est["max_generated_tokens"] == 3 * 64
    assert _run("run", pipe, "--limit", "2").exit_code == 0 and fake.prompts_seen == 2
    text = _run("run", pipe, "--dry-run").stdout
    assert "estimate: 5 rows, 3 cached, 0 deduped, 1 null/empty, 1 to generate" in text
    assert "no speed prediction" in text and fake.prompts_seen == 2


def test_batch_help_has_an_example():
    result = _run("batch", "--help")
    assert result.exit_code == 0 and "xample" in result.stdout and "llmops batch" in result.stdout
