"""benchmarks/gpu_suite.py: the suites file parses, every suite's scripts exist, a suite run writes one record per
command into the records folder (never into the tree), and --ref refuses a tree without the suite's scripts."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))   # the repository root: `benchmarks.*`
from benchmarks import gpu_suite  # noqa: E402

EXPECTED = {"correctness", "headline", "wrangle-short", "product-paths", "moe", "kernels", "policy", "multi-gpu"}


def test_the_suites_file_names_the_suites_and_every_script_exists():
    suites = gpu_suite.load_suites()
    assert set(suites) == EXPECTED
    for suite in suites.values():
        assert suite.about and suite.steps and all(step.timeout_s > 0 for step in suite.steps)
        gpu_suite.check_tree(ROOT, suite, "this tree")          # raises naming a missing script


def test_benchmark_commands_write_records_not_files_in_the_tree():
    for suite in gpu_suite.load_suites().values():
        for step in suite.steps:
            words = step.command.split()
            outs = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("--out", "--trace-out")]
            assert all(o.startswith("/tmp/") for o in outs), step.command          # built models, not results
            assert "$OUT" not in step.command and "tee" not in step.command and ">" not in step.command, step.command


def test_a_malformed_suite_is_an_error_naming_it(tmp_path):
    bad = tmp_path / "suites.toml"
    bad.write_text('[broken]\nabout = "x"\ncommands = [{ timeout_s = 5 }]\n')
    with pytest.raises(ValueError, match="'broken'.*commands\\[0\\]"):
        gpu_suite.load_suites(bad)


def test_a_ref_tree_without_the_scripts_is_refused(tmp_path):
    suite = gpu_suite.load_suites()["kernels"]
    with pytest.raises(SystemExit, match="commit abc has no tests/engine/test_quant_kernels.py"):
        gpu_suite.check_tree(tmp_path, suite, "commit abc")


def test_a_prepared_ref_folder_is_used_as_the_tree(tmp_path, monkeypatch):
    (tmp_path / "abc1234def").mkdir()
    monkeypatch.setattr(gpu_suite, "REFS_DIR", tmp_path)
    with gpu_suite.ref_tree("abc1234") as (tree, sha):
        assert tree == tmp_path / "abc1234def" and sha == "abc1234def"


def test_a_suite_run_appends_one_record_per_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLMOPS_RECORDS_DIR", str(tmp_path))
    monkeypatch.setenv("LLMOPS_MACHINE", "test-machine")
    monkeypatch.setenv("LLMOPS_RUN_ID", "suite-run-1")
    suite = gpu_suite.Suite("tiny", "two shell lines", 0.1, (gpu_suite.Step("echo one; echo two", 60),
                                                             gpu_suite.Step("exit 3", 60)))
    codes = gpu_suite.run_suite(suite, ROOT, gpu_suite.base_env(), None)
    assert codes == [0, 3] and "two" in capsys.readouterr().out
    lines = (tmp_path / "test-machine" / "gpu_suite.jsonl").read_text().splitlines()
    first, second = (json.loads(line) for line in lines)
    assert first["benchmark"] == "gpu_suite" and first["workload"] == "tiny" and first["run_id"] == "suite-run-1"
    assert first["returncode"] == 0 and first["output_tail"] == ["one", "two"] and first["command"] == "echo one; echo two"
    assert second["returncode"] == 3


def test_python_in_a_command_is_the_runner_s_interpreter(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLMOPS_RECORDS_DIR", str(tmp_path))
    suite = gpu_suite.Suite("which", "", 0.1, (gpu_suite.Step("python -c 'import sys; print(sys.prefix)'", 60),))
    assert gpu_suite.run_suite(suite, ROOT, gpu_suite.base_env(), None) == [0]
    assert sys.prefix in capsys.readouterr().out


def test_step_runs_only_the_commands_named(capsys):
    headline = gpu_suite.load_suites()["headline"]
    assert gpu_suite.main(["--suite", "headline", "--step", "2", "--dry-run"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"headline: {headline.steps[1].command}"]


def test_a_step_outside_the_suite_is_a_usage_error_naming_it(capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_suite.main(["--suite", "wrangle-short", "--step", "9", "--dry-run"])
    assert exc.value.code == 2 and "suite 'wrangle-short' has commands 1-3" in capsys.readouterr().err
