"""benchmarks/common: the machine's folder name, where records go, and the record every harness appends."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: `benchmarks.*`
from benchmarks import common  # noqa: E402


@pytest.mark.parametrize("gpu, slug", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                       ("NVIDIA A100-SXM4-80GB", "a100"), ("Tesla T4", "tesla-t4")])
def test_a_gpu_machine_is_named_by_its_model(monkeypatch, gpu, slug):
    monkeypatch.delenv("LLMOPS_MACHINE", raising=False)
    assert common.machine_slug(gpu) == slug


def test_a_cpu_machine_is_named_by_its_cores_and_the_environment_overrides(monkeypatch):
    monkeypatch.delenv("LLMOPS_MACHINE", raising=False)
    assert common.machine_slug(None, cpus=2) == "cpu-2core"
    monkeypatch.setenv("LLMOPS_MACHINE", "rig")
    assert common.machine_slug("NVIDIA H200") == "rig"


def test_records_go_to_the_env_folder_then_out_then_the_tree(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMOPS_RECORDS_DIR", raising=False)
    monkeypatch.delenv("OUT", raising=False)
    assert common.records_dir() == common.RECORDS_DIR
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert common.records_dir() == tmp_path / "out" / "records"
    monkeypatch.setenv("LLMOPS_RECORDS_DIR", str(tmp_path / "r"))
    assert common.records_dir() == tmp_path / "r"


def test_save_record_appends_a_record_with_every_common_field(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMOPS_RECORDS_DIR", str(tmp_path))
    monkeypatch.setenv("LLMOPS_MACHINE", "m")
    monkeypatch.setenv("LLMOPS_RUN_ID", "run-1")
    for rate in (1.0, 2.0):
        record = common.new_record("demo", "tiny", "model-x", gpu_memory="16GiB", commit="abc1234-dirty")
        record["tokens_per_s"] = rate
        path = common.save_record(record)
    assert path == tmp_path / "m" / "demo.jsonl"
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert set(common.COMMON_FIELDS) <= set(first) and list(first)[:len(common.COMMON_FIELDS)] == \
        list(common.COMMON_FIELDS)
    assert first["gpu_memory_gib"] == 16.0 and first["run_id"] == "run-1" and second["tokens_per_s"] == 2.0
    assert first["commit"] == {"sha": "abc1234", "dirty": True, "source": "argument"}


def test_rewrite_replaces_the_record_of_its_key(tmp_path):
    path = tmp_path / "r.jsonl"
    common.rewrite_jsonl(path, {"run_id": "a", "n": 1}, ("run_id",))
    common.rewrite_jsonl(path, {"run_id": "b", "n": 1}, ("run_id",))
    common.rewrite_jsonl(path, {"run_id": "a", "n": 2}, ("run_id",))
    assert common.read_jsonl(path) == [{"run_id": "a", "n": 2}, {"run_id": "b", "n": 1}]


def test_reading_a_missing_records_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.jsonl"):
        common.read_records(tmp_path / "nothing.jsonl")
