"""This machine: its memory, its devices' names, its identity (`profile_key`) and the cache folder.

Also the cheap unmeasured profile of a CPU-only machine and the default cpu-tier budget. Part of the
calibrate layer: it reads the machine (/proc/meminfo, CUDA properties, environment), which the pure policy
package never does. The cached profile itself is `engine.calibrate.profile_cache`.
"""
from __future__ import annotations

import os
import socket

import torch

from engine.policy.hardware import HardwareProfile

# Share of the available RAM a GPU run's cpu tier may use when no cpu budget is given. The cpu tier is pinned
# (page-locked) memory: the kernel can neither swap nor reclaim it, and the driver needs memory of its own
# to map it: on an H200 host with 125 GiB available, a run that pins 87.5 GiB is OOM-killed.
PINNED_SHARE = 0.7


def default_cpu_budget(available: int | None = None) -> int:
    """The cpu-tier budget of a GPU run without an explicit one: PINNED_SHARE of `available` bytes (default:
    the available host RAM now)."""
    return int(PINNED_SHARE * (host_memory_bytes() if available is None else available))


def host_memory_bytes() -> int:
    """Available host RAM in bytes (MemAvailable from /proc/meminfo; total pages as a fallback)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of a CUDA device, or the available host RAM for a CPU device."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory_bytes()


def device_display_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


def default_cpu_profile() -> HardwareProfile:
    """A cheap, unmeasured profile of this CPU-only machine (nominal desktop-class rates, real capacities):
    what planning uses on a CPU when no cached profile exists (`planning.settings.planning_profile`), so no
    test pays for a benchmark."""
    ram = host_memory_bytes()
    return HardwareProfile(
        device_name=device_display_name(torch.device("cpu")), device_type="cpu",
        h2d_gib_s=8.0, d2h_gib_s=8.0, disk_read_gib_s=1.0, disk_write_gib_s=0.5,
        gpu_tflops_bf16=0.2, gpu_mem_gib_s=10.0, cpu_gflops=200.0, cpu_mem_gib_s=10.0,
        gpu_memory_bytes=ram, cpu_memory_bytes=ram, disk_free_bytes=0, layer_overhead_ms=0.2,
        hostname=socket.gethostname(), torch_version=torch.__version__, source="default",
    )


def profile_key(device: torch.device) -> dict[str, str]:
    """What identifies a machine's profile: hostname, device name, torch version."""
    return {"hostname": socket.gethostname(), "device_name": device_display_name(device),
            "torch_version": torch.__version__}
