"""The one budget rule every planning path follows (`engine.calibrate.planning.settings`), and the one place
budget settings are validated."""
from __future__ import annotations

from dataclasses import replace

import pytest

from engine.calibrate.machine import PINNED_SHARE, default_cpu_profile
from engine.calibrate.planning.settings import PlanSettings, resolve_budgets, size_setting
from engine.policy.hardware import GIB, reference_profile

H200 = reference_profile("h200")          # 139 GiB of GPU memory, 126 GiB of host RAM


def test_defaults_come_from_the_profile_rounded_down_to_a_gib():
    b = resolve_budgets(H200, PlanSettings())
    assert b.gpu_bytes == H200.gpu_memory_bytes == 139 * GIB
    assert b.cpu_bytes == int(PINNED_SHARE * 126 * GIB) // GIB * GIB and b.disk_bytes == 0
    odd = replace(H200, gpu_memory_bytes=80 * GIB + 12345, cpu_memory_bytes=100 * GIB + 999)
    assert resolve_budgets(odd, PlanSettings()).gpu_bytes == 80 * GIB


def test_given_budgets_stand_and_the_host_is_shared_by_the_devices():
    b = resolve_budgets(H200, PlanSettings(gpu_memory=16 * GIB, cpu_memory=100 * GIB, disk_memory=500 * GIB,
                                           num_devices=2))
    assert (b.gpu_bytes, b.cpu_bytes, b.disk_bytes) == (16 * GIB, 50 * GIB, 250 * GIB)
    with pytest.raises(ValueError, match="gpu_memory: 200.00 GiB is more than the 139.00 GiB of NVIDIA H200"):
        resolve_budgets(H200, PlanSettings(gpu_memory=200 * GIB))


def test_on_a_cpu_device_the_compute_tier_is_host_ram(tmp_path):
    cpu = replace(default_cpu_profile(), gpu_memory_bytes=12 * GIB, cpu_memory_bytes=12 * GIB)
    assert resolve_budgets(cpu, PlanSettings()).gpu_bytes == 12 * GIB
    assert resolve_budgets(cpu, PlanSettings(cpu_memory=8 * GIB, num_devices=2)).gpu_bytes == 4 * GIB
    assert resolve_budgets(cpu, PlanSettings(gpu_memory=3 * GIB, num_devices=2)).gpu_bytes == 3 * GIB
    disk = resolve_budgets(H200, PlanSettings(disk_dir=tmp_path / "not-made-yet")).disk_bytes
    assert disk >= 0 and disk % GIB == 0


@pytest.mark.parametrize("value, message", [("lots", "gpu_memory: cannot parse size 'lots'"),
                                            (0, "gpu_memory: a budget must be above 0 bytes"),
                                            (True, "gpu_memory: size must be a number")])
def test_size_settings_are_checked_once_naming_the_setting(value, message):
    with pytest.raises(ValueError, match=message):
        size_setting("gpu_memory", value)
    assert size_setting("gpu_memory", "16GiB") == 16 * GIB and size_setting("gpu_memory", None) is None


def test_trials_must_be_a_whole_number():
    with pytest.raises(ValueError, match="trials must be a whole number >= 0"):
        PlanSettings(trials=-1)
