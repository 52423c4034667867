"""What a plan is made under: the settings, the one rule that turns them into budgets, the dtype, the profile.

Every planning path (`LLM`, `engine.plan_model`, hence `llmops policy`, `llmops run` and its `--dry-run`)
resolves its budgets here, so they agree. The rule (`resolve_budgets`):
- the numbers not given come from the hardware profile the plan is made with, never from the memory free
  at the moment: a plan is then a function of its inputs, so it can be previewed in another process, cached
  and found again. A GPU that another process also uses needs an explicit `gpu_memory`;
- gpu: the device's total memory (`HardwareProfile.gpu_memory_bytes`; the search keeps 5% of it free);
- cpu: `PINNED_SHARE` of the host RAM the profile found available (the cpu tier is pinned memory, which
  the kernel can neither swap nor reclaim); on a CPU device the compute tier *is* host RAM: the budget is
  `gpu_memory`, else `cpu_memory`, else the profile's RAM;
- disk: `disk_memory`, else the free space under `disk_dir`, else none;
- measured defaults are rounded down to a whole GiB, so that planning does not follow the few MiB the
  machine's available memory drifts by between processes;
- the host's tiers (cpu, disk) are shared by the devices of one engine: with N devices each plans within
  1/N of them; `gpu_memory` holds on each device.
Sizes are validated once, here (`size_setting`); the runtime enforces the budgets the caller gave.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.calibrate.cpu_dtype import fastest_cpu_dtype
from engine.calibrate.machine import PINNED_SHARE, default_cpu_profile
from engine.calibrate.profile_cache import load_cached_profile, load_or_measure
from engine.policy.estimate import Budgets
from engine.policy.hardware import GIB, HardwareProfile
from engine.util.sizes import format_size, parse_size

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float32": torch.float32, "fp32": torch.float32}


@dataclass(frozen=True)
class PlanSettings:
    """The caller's settings a plan depends on besides the model and the workload. Sizes in bytes (None: the
    default of `resolve_budgets`); `compress_*` None lets the search decide (a preview's
    `--allow-compression`); `trials`: how many of the cost model's best candidates a run measures on
    truncated copies of the model to refine a plan (on a GPU; 0: the cost model decides alone)."""

    gpu_memory: int | None = None
    cpu_memory: int | None = None
    disk_memory: int | None = None
    disk_dir: Path | None = None
    num_devices: int = 1
    parallel: str = "auto"
    compress_weights: bool | None = False
    compress_cache: bool | None = False
    trials: int = 0
    trial_time_s: float = 60.0

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"plan settings: num_devices must be >= 1, got {self.num_devices}")
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 0:
            raise ValueError(f"trials must be a whole number >= 0, got {self.trials!r}")


def size_setting(name: str, value: int | str | None) -> int | None:
    """A budget setting (`gpu_memory`, `cpu_memory`, `disk_memory`) in bytes: an int or a string like
    "16GiB"; None stays None. ValueError naming the setting for anything else, 0 included (a tier with no
    memory is not a budget: leave it out)."""
    if value is None:
        return None
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    if size <= 0:
        raise ValueError(f"{name}: a budget must be above 0 bytes, got {value!r}")
    return size


def _floor_gib(n: float) -> int:
    """`n` bytes rounded down to a whole GiB (as is below one GiB)."""
    n = int(n)
    return n // GIB * GIB if n >= GIB else n


def resolve_budgets(profile: HardwareProfile, settings: PlanSettings) -> Budgets:
    """Each device's budgets for a plan under `settings` on the machine `profile` describes (the rule is the
    module docstring's). Raises ValueError when `gpu_memory` exceeds the device's memory."""
    n = settings.num_devices
    if profile.device_type != "cuda":
        host = settings.cpu_memory or _floor_gib(profile.gpu_memory_bytes)
        return Budgets(gpu_bytes=settings.gpu_memory or host // n, cpu_bytes=0)
    gpu = settings.gpu_memory or _floor_gib(profile.gpu_memory_bytes)
    if gpu > profile.gpu_memory_bytes:
        raise ValueError(f"gpu_memory: {format_size(gpu)} is more than the {format_size(profile.gpu_memory_bytes)} "
                         f"of {profile.device_name}")
    cpu = settings.cpu_memory or _floor_gib(PINNED_SHARE * profile.cpu_memory_bytes)
    disk = settings.disk_memory
    if disk is None and settings.disk_dir is not None:
        folder = Path(settings.disk_dir)
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent                   # the folder is made when the run starts
        disk = _floor_gib(shutil.disk_usage(folder).free)
    return Budgets(gpu_bytes=gpu, cpu_bytes=cpu // n, disk_bytes=(disk or 0) // n)


def compute_dtype(dtype: str | torch.dtype, device_type: str) -> torch.dtype:
    """The compute dtype: "auto" is bfloat16 on CUDA (float16 on a local GPU without bf16) and, on a CPU,
    whichever of bfloat16 and float32 multiplies faster there, measured once per machine and cached
    (`engine.calibrate.cpu_dtype`), so every process on the machine resolves it alike. A name or a
    torch.dtype otherwise (ValueError naming the accepted names)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device_type != "cuda":
            return fastest_cpu_dtype()
        local_fp16 = torch.cuda.is_available() and not torch.cuda.is_bf16_supported()
        return torch.float16 if local_fp16 else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: unsupported {dtype!r}; use 'auto' or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def planning_profile(device: torch.device | str) -> HardwareProfile:
    """The hardware profile plans for `device` are made with: on CUDA this machine's, measured once (about a
    minute) and cached; on a CPU the cached one when `llmops profile` measured it, else a cheap unmeasured
    default (nothing to place there, so no benchmark runs)."""
    device = torch.device(device)
    if device.type == "cuda":
        return load_or_measure(device)
    return load_cached_profile(device) or default_cpu_profile()
