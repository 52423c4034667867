"""benchmarks/kernels/kv_slot_speed.py on the CPU at a tiny shape with a shared prefix: one record, every placement's
parts, the decode's host seconds within its wall."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: `benchmarks.*`
from benchmarks.kernels import kv_slot_speed  # noqa: E402


def test_cpu_smoke_run_with_a_prefix(tmp_path):
    out = tmp_path / "k.jsonl"
    kv_slot_speed.main(["--rows", "4", "--heads", "8", "--kv-heads", "2", "--context", "24", "--prefix", "10",
                        "--repeats", "2", "--out", str(out)])
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["benchmark"] == "kv_slot_speed" and rec["prefix"] == 10
    assert set(rec["placements"]) == {"gpu", "cpu", "split"}
    for part in rec["placements"].values():
        assert part["decode_s"] > 0 and 0 < part["decode_host_s"] <= part["decode_s"]
    assert rec["placements"]["gpu"]["home_bytes_loaded"] == 0 < rec["placements"]["cpu"]["home_bytes_loaded"]
