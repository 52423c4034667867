"""README.md's performance table is what benchmarks/readme_table.py renders from the committed results."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import readme_table  # noqa: E402


def test_readme_table_is_rendered_from_the_committed_results():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme_table.current(readme) == readme_table.render(), \
        "README.md's table is stale: run python benchmarks/readme_table.py"


def test_every_row_names_a_committed_file_and_a_changed_result_changes_the_table(tmp_path, monkeypatch):
    for row in readme_table.ROWS:
        assert (readme_table.RESULTS / row.file).is_file(), row.file
    before = readme_table.render()
    copy = tmp_path / "results"
    copy.mkdir()
    (copy / "h200").mkdir()
    for row in readme_table.ROWS:
        (copy / row.file).write_bytes((readme_table.RESULTS / row.file).read_bytes())
    data = json.loads((copy / "address_accuracy_addresses.json").read_text())
    data["exact_match"] = 0.5
    (copy / "address_accuracy_addresses.json").write_text(json.dumps(data))
    monkeypatch.setattr(readme_table, "RESULTS", copy)
    after = readme_table.render()
    assert after != before and "exact match **50.0%**" in after


def test_a_readme_without_the_markers_is_an_error_naming_the_marker():
    with pytest.raises(ValueError, match="perf-table:begin"):
        readme_table.current("# no table here\n")


def test_a_failed_path_shows_no_ratio_and_keeps_the_run_before_it():
    ok = {"path": "pipeline", "timestamp": "2026-12-01T00:00:00", "ratio_to_engine": 0.97, "error": None}
    failed = {"path": "pipeline", "timestamp": "2026-12-03T00:00:00", "ratio_to_engine": None,
              "error": "ModuleNotFoundError: No module named 'pydantic'"}
    engine = {"path": "engine", "timestamp": "2026-12-03T00:00:00", "ratio_to_engine": 1.0}
    assert readme_table.job_paths([ok, engine, failed]) == "pipeline 0.970"        # three places: 0.898 is no 0.90
