"""The CPU's measured answers beside the dtype: the int4 kernel's row crossing is stored, read back and, when
missing or malformed, measured again."""
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
    return calls


def test_choice_holds_the_int4_crossing(tmp_path, fake_measure):
    choice = cpu_dtype.machine_cpu_choice(tmp_path)
    assert choice == cpu_dtype.CpuChoice(torch.bfloat16, 8) and fake_measure == ["dtype", "int4"]
    data = json.loads(cpu_dtype.cache_path(tmp_path).read_text())
    assert data["int4_max_rows"] == 8 and data["version"] == cpu_dtype.CACHE_VERSION
    assert cpu_dtype.machine_cpu_choice(tmp_path) == choice and len(fake_measure) == 2     # read, not timed


@pytest.mark.parametrize("rows", [0, -1, "4", True, None])
def test_malformed_crossing_is_measured_again(tmp_path, fake_measure, rows):
    path = cpu_dtype.cache_path(tmp_path)
    path.write_text(json.dumps({"version": cpu_dtype.CACHE_VERSION, "key": cpu_dtype.machine_key(),
                                "dtype": "float32", "int4_max_rows": rows}))
    assert cpu_dtype.read_choice(path) is None
    assert cpu_dtype.machine_cpu_choice(tmp_path).int4_max_rows == 8 and len(fake_measure) == 2


def test_int4_crossing_is_measured_in_whole_rows():
    rows = cpu_dtype.measure_int4_rows(repeats=1)
    assert rows in (1, *cpu_dtype._INT4_ROWS)
