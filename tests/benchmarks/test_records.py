"""benchmarks/records/: few files, each cited by the docs, each line a record naming its command, commit and
machine."""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "benchmarks" / "records"
MAX_FILES = 40
COMMON = ("run_id", "system", "benchmark", "workload", "model", "gpu_memory_gib", "tokens_per_s", "rows_per_h",
          "peak_device_gib", "device", "commit", "command", "timestamp")


def record_files() -> list[Path]:
    return sorted(p for p in RECORDS.rglob("*") if p.is_file())


def docs_text() -> str:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n".join(p.read_text(encoding="utf-8") for p in pages if p.is_file())


def test_there_are_at_most_forty_record_files():
    files = record_files()
    assert 0 < len(files) <= MAX_FILES, f"{len(files)} files under benchmarks/records/ (at most {MAX_FILES})"


def test_every_record_file_is_cited_by_the_readme_or_the_docs():
    text = docs_text()
    missing = [str(p.relative_to(ROOT)) for p in record_files() if str(p.relative_to(ROOT)) not in text]
    assert not missing, f"record files no page of README.md or docs/ cites: {missing}"


def test_every_file_is_machine_slash_benchmark_jsonl_of_records_of_that_benchmark():
    for path in record_files():
        rel = path.relative_to(RECORDS)
        assert len(rel.parts) == 2 and path.suffix == ".jsonl", f"{rel}: not <machine>/<benchmark>.jsonl"
        lines = path.read_text(encoding="utf-8").splitlines()
        assert lines, f"{rel} is empty"
        for n, line in enumerate(lines, 1):
            rec = json.loads(line)
            where = f"{rel} line {n}"
            assert set(COMMON) <= set(rec), f"{where} lacks {sorted(set(COMMON) - set(rec))}"
            assert rec["benchmark"] == path.stem, f"{where}: benchmark {rec['benchmark']!r}"
            assert rec["command"] and rec["run_id"], f"{where}: no command or run_id"
            assert (rec["commit"] or {}).get("sha"), f"{where}: no commit"
