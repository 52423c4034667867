"""benchmarks/profiling/timeline.py: a traced run's device events split into prefill and decode at the selection marks,
with per-stream busy time, the compute stream's gaps and kernel seconds by category."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: `benchmarks.*`
from benchmarks.profiling.timeline import (SELECT_MARK, DeviceEvent, category, device_events, main,  # noqa: E402
                                           phase_summary, read_events, timeline_summary, write_events)


def _events() -> tuple[list[DeviceEvent], list[tuple[float, float]]]:
    """Stream 7 computes: a GEMM 0-100, an elementwise kernel 150-160 (a 50 us gap), the argmax 160-170;
    stream 9 copies 0-120. The selection mark at 200-210; then a decode step: GEMM 300-400, copy 300-350,
    argmax 400-405; the last mark at 500-505 (the selections' ends, 210 and 505, split the phases)."""
    ev = [DeviceEvent("nvjet_sm90_hsh_128x256", 7, 0, 100),
          DeviceEvent("Memcpy HtoD (Pinned -> Device)", 9, 0, 120),
          DeviceEvent("void at::native::elementwise_kernel<128, 4>", 7, 150, 160),
          DeviceEvent("void at::native::reduce_kernel<argmax>", 7, 160, 170),
          DeviceEvent("nvjet_sm90_hsh_128x256", 7, 300, 400), DeviceEvent("Memcpy HtoD (Pinned -> Device)", 9, 300, 350),
          DeviceEvent("void at::native::reduce_kernel<argmax>", 7, 400, 405)]
    return ev, [(200.0, 210.0), (500.0, 505.0)]


def test_phases_split_at_the_selection_marks():
    ev, marks = _events()
    out = timeline_summary(ev, marks)
    pre, dec = out["prefill"], out["decode"]
    assert pre["events"] == 4 and dec["events"] == 3
    assert abs(pre["wall_s"] - 170e-6) < 1e-9
    assert pre["compute_stream"] == 7
    assert abs(pre["compute_busy_s"] - 120e-6) < 1e-9                 # 0-100 and 150-170
    assert pre["compute_gaps"]["count"] == 1 and abs(pre["compute_gaps"]["total_s"] - 50e-6) < 1e-9
    assert pre["stream_busy_s"]["9"] == round(120e-6, 4)
    assert abs(pre["device_idle_s"] - 30e-6) < 1e-9                   # 120-150: nothing on either stream
    assert pre["by_category"]["gemm"]["calls"] == 1 and pre["by_category"]["copy"]["calls"] == 1
    assert set(pre["by_category"]) == {"gemm", "copy", "elementwise", "reduce"}
    assert dec["top_kernels"][0]["category"] == "gemm"
    assert out["step_walls_s"] == [round(295e-6, 4)]


def test_categories():
    assert category("fmha_cutlassF_f16_aligned_64x128_rf_sm80") == "attention"
    assert category("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>") == "cat"
    assert category("_affine_dequant_kernel") == "triton"
    assert category("Memset (Device)") == "copy"
    assert category("something_else") == "other"


def test_empty_phase_and_no_marks():
    ev, _ = _events()
    assert phase_summary(ev, 1000, 2000) == {"wall_s": 0.0, "events": 0}
    assert set(timeline_summary(ev, [])) == {"all"}
    assert timeline_summary([], []) == {}


def test_device_events_reads_a_profile_and_writes_the_compact_file(tmp_path):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(SELECT_MARK):
            torch.ones(4).sum()
    events, marks = device_events(prof)
    assert events == [] and len(marks) == 1 and marks[0][1] >= marks[0][0]
    ev, m = _events()
    write_events(tmp_path / "t.json.gz", ev, m)
    data = json.loads(gzip.open(tmp_path / "t.json.gz", "rt").read())
    assert len(data["events"]) == len(ev) and data["marks"][0] == [200.0, 210.0]
    assert data["names"][data["events"][1][0]].startswith("Memcpy")
    assert read_events(tmp_path / "t.json.gz") == (ev, m)                      # read back as written
    assert main([str(tmp_path / "t.json.gz")]) == timeline_summary(ev, m)     # the script prints the phases
