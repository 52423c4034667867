"""HardwareProfile: JSON cache round-trip, corrupt or foreign cache files re-measured, a tiny real measure."""
import json
from dataclasses import replace

import pytest
import torch

from engine.calibrate.machine import default_cpu_profile
from engine.calibrate.profile_cache import (
    PROFILE_VERSION, load_cached_profile, load_or_measure, load_profile, profile_cache_path, save_profile,
)
from engine.policy.hardware import HardwareProfile, reference_profile


class FakeMeasure:
    """Counts calls; returns a fixed profile keyed to this machine."""

    def __init__(self):
        self.calls = 0

    def __call__(self, device, **kwargs):
        self.calls += 1
        return replace(default_cpu_profile(), h2d_gib_s=float(self.calls), source="measured",
                       slot_decode_ms=0.2, slot_off_cache_ms=0.1)


def test_profile_json_round_trip(tmp_path):
    profile = reference_profile("h200")
    save_profile(profile, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile
    assert not list(tmp_path.glob("*.tmp"))                 # written via a temporary name, renamed


def test_cache_is_measured_once_then_reused(tmp_path):
    fake = FakeMeasure()
    first = load_or_measure("cpu", directory=tmp_path, measure_fn=fake)
    second = load_or_measure("cpu", directory=tmp_path, measure_fn=fake)
    assert fake.calls == 1 and second == first
    third = load_or_measure("cpu", directory=tmp_path, measure_fn=fake, refresh=True)
    assert fake.calls == 2 and third.h2d_gib_s == 2.0


@pytest.mark.parametrize("content", [
    "{not json", "", json.dumps({"version": 1, "profile": {"device_name": "x"}}),
    json.dumps({"version": 99, "profile": {}}), "[1, 2]",
])
def test_corrupt_cache_is_remeasured_not_used(tmp_path, content):
    fake = FakeMeasure()
    path = profile_cache_path(torch.device("cpu"), tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    assert load_cached_profile(torch.device("cpu"), tmp_path) is None
    profile = load_or_measure("cpu", directory=tmp_path, measure_fn=fake)
    assert fake.calls == 1 and profile.h2d_gib_s == 1.0
    assert load_profile(path) == profile                   # the bad file was replaced


def test_cache_of_older_probes_is_remeasured(tmp_path):
    """A valid profile that older probes wrote (PROFILE_VERSION - 1) is read by load_profile but not reused
    as this machine's cache: its 4-bit CPU attention rate timed a path the engine no longer runs."""
    fake = FakeMeasure()
    old = load_or_measure("cpu", directory=tmp_path, measure_fn=fake)
    path = profile_cache_path(torch.device("cpu"), tmp_path)
    path.write_text(json.dumps({"version": PROFILE_VERSION - 1, "profile": old.to_dict()}))
    assert load_profile(path) == old and load_cached_profile(torch.device("cpu"), tmp_path) is None
    fresh = load_or_measure("cpu", directory=tmp_path, measure_fn=fake)
    assert fake.calls == 2 and fresh.h2d_gib_s == 2.0
    assert json.loads(path.read_text())["version"] == PROFILE_VERSION


def test_cache_of_another_machine_is_not_used(tmp_path):
    fake = FakeMeasure()
    path = profile_cache_path(torch.device("cpu"), tmp_path)
    save_profile(replace(default_cpu_profile(), hostname="elsewhere"), path)
    load_or_measure("cpu", directory=tmp_path, measure_fn=fake)
    assert fake.calls == 1


def test_env_var_sets_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPS_CACHE_DIR", str(tmp_path))
    assert profile_cache_path(torch.device("cpu")).parent == tmp_path


@pytest.mark.parametrize("change, message", [
    ({"h2d_gib_s": -1.0}, "h2d_gib_s must be a positive number"),
    ({"gpu_memory_bytes": "lots"}, "gpu_memory_bytes must be a non-negative integer"),
    ({"bogus": 1}, "unknown field"),
])
def test_from_dict_names_the_bad_field(change, message):
    data = {**reference_profile("h200").to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        HardwareProfile.from_dict(data)


def test_missing_field_is_named():
    data = reference_profile("h200").to_dict()
    del data["d2h_gib_s"]
    with pytest.raises(ValueError, match="missing field.*d2h_gib_s"):
        HardwareProfile.from_dict(data)


def test_tiny_real_measure_on_cpu(tmp_path):
    from engine.calibrate.measure import measure

    torch.set_num_threads(1)
    p = measure("cpu", size_mib=4, disk_dir=tmp_path, disk_size_mib=4, cpu_matmul_n=64, repeats=1)
    assert p.device_type == "cpu" and p.source == "measured"
    for name in ("h2d_gib_s", "d2h_gib_s", "disk_read_gib_s", "disk_write_gib_s", "gpu_tflops_bf16",
                 "gpu_mem_gib_s", "cpu_gflops", "cpu_mem_gib_s", "layer_overhead_ms", "slot_prefill_ms",
                 "slot_decode_ms", "cpu_attention_slot_ms", "cpu_attention_gib_s", "cpu_attention_q4_gib_s",
                 "dequant_gib_s", "slot_gpu_cache_q4_ms", "slot_off_cache_ms", "slot_off_cache_q4_ms",
                 "slot_off_weights_ms", "layer_q4_weights_ms"):
        assert getattr(p, name) > 0, name
    assert p.cpu_memory_bytes > 0 and not list(tmp_path.iterdir())   # the probe file is removed
    # no fused 4-bit kernel on a CPU device: unmeasured, so the cost model keeps its roofline there
    assert p.gpu_q4_attention_kv_ns == p.gpu_q4_attention_q_ns == 0.0 and p.gpu_q4_attention_s(8, 64) is None


def test_fused_attention_seconds_count_kv_heads_and_query_heads():
    p = replace(reference_profile("h200"), gpu_q4_attention_kv_ns=3.0, gpu_q4_attention_q_ns=0.5)
    assert p.gpu_q4_attention_s(8, 64) == pytest.approx((8 * 3.0 + 64 * 0.5) * 1e-9)
    assert p.gpu_q4_attention_s(56, 56) == pytest.approx(56 * 3.5 * 1e-9)


def test_unknown_reference_is_an_error():
    with pytest.raises(ValueError, match="unknown reference hardware 'a100'"):
        reference_profile("a100")
