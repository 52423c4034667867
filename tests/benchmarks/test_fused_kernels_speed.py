"""benchmarks/kernels/fused_kernels_speed.py on the CPU at a small scale: one record with every case per dtype, the
kernels' results at parity with the torch ops (both paths are the torch ops here)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: `benchmarks.*`
from benchmarks.kernels import fused_kernels_speed  # noqa: E402


def test_cpu_smoke_run_writes_a_record(tmp_path):
    out = tmp_path / "fused.jsonl"
    fused_kernels_speed.main(["--device", "cpu", "--scale", "256", "--repeat", "1", "--dtype", "bfloat16",
                              "--out", str(out)])
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["benchmark"] == "fused_kernels_speed" and rec["workload"] == "llama-3-70b-prefill-div256"
    cases = rec["results"]["bfloat16"]
    assert sorted(cases) == ["decode_q4", "quantize_decode", "quantize_k", "rms_norm", "rope_decode", "rope_prefill",
                             "silu_mul"]
    assert cases["decode_q4"]["shape"] == [9, 64, 8, 150, 60]
    assert cases["rms_norm"]["shape"] == [16, 8192] and cases["quantize_k"]["shape"] == [1, 8, 50, 128]
    assert cases["rope_prefill"]["shape"] == [1, 64, 50, 128] and cases["rope_decode"]["shape"] == [6, 64, 1, 128]
    assert all(c["parity"] in ("ok", "within 1 ulp", "bit for bit", "within float rounding") for c in cases.values())
    assert all(c["torch_ms"] > 0 and c["fused_ms"] > 0 for c in cases.values())
    assert all(c["torch_host_us"] > 0 and c["fused_host_us"] > 0 for c in cases.values())
