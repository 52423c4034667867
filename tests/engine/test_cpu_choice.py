"""The CPU's measured answers beside the dtype: the int4 kernel's row crossings (against dequantize + GEMM and
against a packed dense copy) are stored, read back and, when missing or malformed, measured again."""
from __future__ import annotations

import json

import pytest
import torch

from engine.calibrate import cpu_dtype


@pytest.fixture
def fake_measure(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(cpu_dtype, "measure_cpu_dtype",
                        lambda: (calls.append("dtype") or torch.bfloat16, {"bfloat16_s": 1.0, "float32_s": 2.0}))
    monkeypatch.setattr(cpu_dtype, "measure_int4_rows", lambda: calls.append("int4") or 8)
    monkeypatch.setattr(cpu_dtype, "measure_int4_dense_rows", lambda: calls.append("int4 dense") or 2)
    return calls


def test_choice_holds_the_int4_crossing(tmp_path, fake_measure):
    choice = cpu_dtype.machine_cpu_choice(tmp_path)
    assert choice == cpu_dtype.CpuChoice(torch.bfloat16, 8, None) and fake_measure == ["dtype", "int4"]
    data = json.loads(cpu_dtype.cache_path(tmp_path).read_text())
    assert data["int4_max_rows"] == 8 and data["int4_dense_max_rows"] is None
    assert data["version"] == cpu_dtype.CACHE_VERSION
    assert cpu_dtype.machine_cpu_choice(tmp_path) == choice and len(fake_measure) == 2     # read, not timed


def test_dense_crossing_is_measured_when_first_asked_and_kept(tmp_path, fake_measure):
    dense = 2 if cpu_dtype.onednn_bf16() else cpu_dtype.INT4_DENSE_MAX_ROWS
    assert cpu_dtype.machine_dense_rows(tmp_path) == dense
    measured = ["dtype", "int4", "int4 dense"] if cpu_dtype.onednn_bf16() else ["dtype", "int4"]
    assert fake_measure == measured
    assert cpu_dtype.machine_dense_rows(tmp_path) == dense and fake_measure == measured     # read, not timed
    data = json.loads(cpu_dtype.cache_path(tmp_path).read_text())
    assert data["int4_max_rows"] == 8 and data["seconds"] == {"bfloat16_s": 1.0, "float32_s": 2.0}
    assert data["int4_dense_max_rows"] == (2 if cpu_dtype.onednn_bf16() else None)


@pytest.mark.parametrize("field", ["int4_max_rows", "int4_dense_max_rows"])
@pytest.mark.parametrize("rows", [0, -1, "4", True])
def test_malformed_crossing_is_measured_again(tmp_path, fake_measure, rows, field):
    path = cpu_dtype.cache_path(tmp_path)
    path.write_text(json.dumps({"version": cpu_dtype.CACHE_VERSION, "key": cpu_dtype.machine_key(),
                                "dtype": "float32", "int4_max_rows": 4, "int4_dense_max_rows": 4, field: rows}))
    assert cpu_dtype.read_choice(path) is None
    assert cpu_dtype.machine_cpu_choice(tmp_path).int4_max_rows == 8 and fake_measure == ["dtype", "int4"]


def test_missing_int4_crossing_is_measured_again(tmp_path, fake_measure):
    path = cpu_dtype.cache_path(tmp_path)
    path.write_text(json.dumps({"version": cpu_dtype.CACHE_VERSION, "key": cpu_dtype.machine_key(),
                                "dtype": "float32", "int4_max_rows": None}))
    assert cpu_dtype.read_choice(path) is None
    assert cpu_dtype.machine_cpu_choice(tmp_path).int4_max_rows == 8


def test_int4_crossing_is_measured_in_whole_rows():
    rows = cpu_dtype.measure_int4_rows(repeats=1)
    assert rows in (1, *cpu_dtype._INT4_ROWS)


@pytest.mark.skipif(not cpu_dtype.onednn_bf16(), reason="this torch build runs no bfloat16 oneDNN matmul here")
def test_dense_copy_crossing_is_measured_in_whole_rows():
    rows = cpu_dtype.measure_int4_dense_rows(repeats=1, cold=8 << 20)
    assert rows in (1, *cpu_dtype._INT4_ROWS)
    assert (64 << 20) <= cpu_dtype.cold_bytes() <= (1 << 30)
