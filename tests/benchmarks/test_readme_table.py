"""README.md's performance table is what benchmarks/readme_table.py renders from the records."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))   # the repository root: `benchmarks.*`
from benchmarks import readme_table  # noqa: E402


def test_readme_table_is_rendered_from_the_records():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme_table.current(readme) == readme_table.render(), \
        "README.md's table is stale: run python benchmarks/readme_table.py"


def test_every_row_names_a_record_file_and_a_changed_record_changes_the_table(tmp_path, monkeypatch):
    for row in readme_table.ROWS:
        assert (readme_table.RECORDS / row.file).is_file(), row.file
    before = readme_table.render()
    copy = tmp_path / "records"
    shutil.copytree(readme_table.RECORDS, copy)
    path = copy / "cpu-2core" / "cpu_generate.jsonl"
    rec = json.loads(path.read_text().splitlines()[-1])
    rec["per_dtype"]["float32"]["transformers"]["best"]["tokens_per_s"] = \
        rec["per_dtype"]["float32"]["ours"]["best"]["tokens_per_s"] / 4
    path.write_text(json.dumps(rec) + "\n")
    monkeypatch.setattr(readme_table, "RECORDS", copy)
    after = readme_table.render()
    assert after != before and "(**4.00x**)" in after


def test_a_readme_without_the_markers_is_an_error_naming_the_marker():
    with pytest.raises(ValueError, match="perf-table:begin"):
        readme_table.current("# no table here\n")


def test_a_missing_record_file_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(readme_table, "RECORDS", tmp_path)
    with pytest.raises(FileNotFoundError, match="cpu_generate.jsonl"):
        readme_table.render()


def _path_record(path: str, order: int, ratio: float | None, error: str | None = None) -> dict:
    return {"run_id": "r1", "timestamp": "t", "workload": "invoices", "path": path, "order": order,
            "rows_per_h": 100.0, "ratio_to_engine": ratio, "error": error, "device": "cpu (2 cores)"}


def test_a_failed_path_shows_no_ratio_and_the_others_keep_theirs():
    records = [_path_record("engine", 0, 1.0), _path_record("pipeline", 1, 0.97),
               _path_record("polars", 2, None, "ModuleNotFoundError: No module named 'pydantic'")]
    text = readme_table.product_paths("invoices")(records)
    assert "pipeline 0.970" in text and "polars" not in text and "2-core CPU" in text   # 0.898 is no 0.90


def test_ratios_come_from_one_run():
    """Ours and the peer of the latest run that finished both: a later run of ours alone does not pair with an
    earlier run's peer."""
    def rec(run, system, tok, ts):
        return {"run_id": run, "system": system, "model": "opt-30b", "ok": True, "tokens_per_s": tok,
                "timestamp": ts, "config_name": "c", "device": "NVIDIA H200"}
    records = [rec("a", "llmops", 100.0, "1"), rec("a", "flexgen", 50.0, "1"), rec("b", "llmops", 300.0, "2")]
    assert "(**2.00x**)" in readme_table.vs_flexgen(records)
