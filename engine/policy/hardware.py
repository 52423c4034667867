"""`HardwareProfile`: what one machine can move and compute, measured once and cached as JSON.

Units are in the field names (GiB/s are 2**30 bytes per second). The "gpu" tier is the compute device: on a
machine without a GPU it is the CPU, and h2d/d2h become host memcpy. The cache file is keyed by hostname +
device name + torch version, lives in `$LLMOPS_CACHE_DIR` or `~/.cache/llmops`, is written to a temporary
name and renamed into place, and is re-measured (never used) when it does not parse or its key differs.
The microbenchmark itself lives in `engine.policy.measure`.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

import torch

from engine.storage.atomic import write_json_atomic

GIB = 1024**3
PROFILE_VERSION = 3    # 2: executor slot, CPU attention and dequantization probes; 3: slot extras by placement


@dataclass(frozen=True)
class HardwareProfile:
    """Bandwidths, compute rates and capacities of one machine (gpu = the compute device)."""

    device_name: str
    device_type: str                 # "cuda" or "cpu"
    h2d_gib_s: float                 # pinned host -> device copy
    d2h_gib_s: float                 # device -> pinned host copy
    disk_read_gib_s: float           # cold read of a file under the disk dir
    disk_write_gib_s: float          # write + fsync
    gpu_tflops_bf16: float           # large matmul on the compute device (bf16; fp32 on a CPU device)
    gpu_mem_gib_s: float             # device memory bandwidth (copy: read + write bytes)
    cpu_gflops: float                # host fp32 matmul
    cpu_mem_gib_s: float             # host attention-like batched GEMV, bytes of K/V read per second
    gpu_memory_bytes: int
    cpu_memory_bytes: int
    disk_free_bytes: int
    layer_overhead_ms: float = 0.3   # fixed cost of launching one layer's ~20 kernels for one GPU batch
    # Measured on the real executor and kernels (0 = not measured: derived, see the properties below)
    slot_prefill_ms: float = 0.0     # executor host time per (decoder layer, GPU batch) at prefill
    slot_decode_ms: float = 0.0      # executor host time per (decoder layer, GPU batch) per decode step
    cpu_attention_slot_ms: float = 0.0   # extra per (decoder layer, GPU batch) with CPU attention (sync, copies)
    # extra executor host time per decode slot by what the slot does (GPU attention), see SlotCosts
    slot_gpu_cache_q4_ms: float = 0.0    # a 4-bit cache segment on the gpu (quantize new k/v, dequantize)
    slot_off_cache_ms: float = 0.0       # a cache segment off the gpu: load, stage, store
    slot_off_cache_q4_ms: float = 0.0    # the same for a 4-bit cache (plus quantize and dequantize)
    slot_off_act_ms: float = 0.0         # hidden states parked off the gpu: store, load
    slot_off_weights_ms: float = 0.0     # weights off the gpu: a page of copies into the layer buffer
    layer_q4_weights_ms: float = 0.0     # per layer and step (not slot): dequantizing 4-bit weights
    cpu_attention_gib_s: float = 0.0     # cpu_decode_attention, dense K+V bytes read per second
    cpu_attention_q4_gib_s: float = 0.0  # the same over a 4-bit cache, in dense-equivalent bytes per second
    dequant_gib_s: float = 0.0           # 4-bit dequantization on the device, dense bytes written per second
    hostname: str = ""
    torch_version: str = ""
    source: str = "measured"         # "measured", "reference:<name>", "default", "file:<path>"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def prefill_slot_s(self) -> float:
        """Seconds of executor host time per (decoder layer, GPU batch) at prefill."""
        return (self.slot_prefill_ms or self.layer_overhead_ms) * 1e-3

    @property
    def decode_slot_s(self) -> float:
        """Seconds of executor host time per (decoder layer, GPU batch) per decode step."""
        return (self.slot_decode_ms or self.layer_overhead_ms) * 1e-3

    @property
    def cpu_attention_slot_s(self) -> float:
        """Extra seconds per (decoder layer, GPU batch) of a decode step with CPU attention (default 0.1 ms)."""
        return (self.cpu_attention_slot_ms or 0.1) * 1e-3

    def decode_slot_extras_s(self, compressed_cache: bool, cpu_attention: bool) -> tuple[float, float, float, float]:
        """Seconds a decode slot adds over `decode_slot_s` for (a cache segment on the gpu, a cache segment
        off the gpu, hidden states off the gpu, weights off the gpu) under these flags
        (`cost_model.SlotCosts`)."""
        gpu_cache = self.slot_gpu_cache_q4_ms * 1e-3 if compressed_cache else 0.0
        if cpu_attention:
            off_cache = self.cpu_attention_slot_s
        else:
            off_cache = (self.slot_off_cache_q4_ms if compressed_cache else self.slot_off_cache_ms) * 1e-3
        return gpu_cache, off_cache, self.slot_off_act_ms * 1e-3, self.slot_off_weights_ms * 1e-3

    @property
    def cpu_attention_bytes_s(self) -> float:
        """Bytes of dense K+V per second CPU attention reads (default: the GEMV probe's rate)."""
        return (self.cpu_attention_gib_s or self.cpu_mem_gib_s) * GIB

    @property
    def cpu_attention_q4_bytes_s(self) -> float:
        """Dense-equivalent K+V bytes per second of CPU attention over a 4-bit cache (default: 1/4 of dense)."""
        return self.cpu_attention_q4_gib_s * GIB if self.cpu_attention_q4_gib_s else self.cpu_attention_bytes_s / 4

    @property
    def dequant_bytes_s(self) -> float:
        """Dense bytes per second the device's 4-bit dequantization writes (default: 1/4 of the copy rate)."""
        return self.dequant_gib_s * GIB if self.dequant_gib_s else self.gpu_mem_gib_s * GIB / 4

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HardwareProfile":
        """Build from a dict; raises ValueError naming missing/unknown fields or a wrongly typed value."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"HardwareProfile: unknown field(s) {unknown}")
        required = [n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING]
        missing = sorted(n for n in required if n not in data)
        if missing:
            raise ValueError(f"HardwareProfile: missing field(s) {missing}")
        values: dict[str, Any] = {}
        for name, value in data.items():
            kind = known[name].type
            if kind in ("float", float):
                optional = known[name].default == 0.0
                if (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
                        or (value == 0 and not optional)):
                    raise ValueError(f"HardwareProfile.{name} must be a positive number, got {value!r}")
                values[name] = float(value)
            elif kind in ("int", int):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"HardwareProfile.{name} must be a non-negative integer, got {value!r}")
                values[name] = value
            else:
                if not isinstance(value, str):
                    raise ValueError(f"HardwareProfile.{name} must be a string, got {value!r}")
                values[name] = value
        return cls(**values)

    def with_capacities(self, gpu_memory_bytes: int | None = None, cpu_memory_bytes: int | None = None,
                        disk_free_bytes: int | None = None) -> "HardwareProfile":
        """A copy with the given capacities replaced (None keeps the measured one)."""
        data = self.to_dict()
        for name, value in (("gpu_memory_bytes", gpu_memory_bytes), ("cpu_memory_bytes", cpu_memory_bytes),
                            ("disk_free_bytes", disk_free_bytes)):
            if value is not None:
                data[name] = int(value)
        return HardwareProfile(**data)


def reference_profile(name: str) -> HardwareProfile:
    """A built-in profile of a known machine. "h200": the lent H200 host (ENVIRONMENT.md, measured
    2026-11-29): pinned copies 51.4/51.5 GiB/s, disk 1.30/1.35 GB/s, bf16 linear ~690 TFLOP/s sustained,
    4.23 TB/s copy, CPU fp32 1.55 TFLOP/s, CPU batched GEMV ~105 GB/s, 139 GiB GPU, 126 GiB RAM, 64 GiB disk
    (60 GiB counted free). The 0.5 ms per layer and GPU batch is what FlexGen's all-on-GPU OPT-6.7B run at
    batch 2 implies (18 ms per decode step over 32 layers)."""
    if name == "h200":
        return HardwareProfile(
            device_name="NVIDIA H200", device_type="cuda",
            h2d_gib_s=51.4, d2h_gib_s=51.5,
            disk_read_gib_s=1.30e9 / GIB, disk_write_gib_s=1.35e9 / GIB,
            gpu_tflops_bf16=690.0, gpu_mem_gib_s=4.23e12 / GIB,
            cpu_gflops=1550.0, cpu_mem_gib_s=105e9 / GIB,
            gpu_memory_bytes=139 * GIB, cpu_memory_bytes=126 * GIB, disk_free_bytes=60 * GIB,
            layer_overhead_ms=0.5, hostname="reference", torch_version="", source="reference:h200",
        )
    raise ValueError(f"unknown reference hardware {name!r}; known: ['h200']")


REFERENCE_NAMES = ("h200",)


# Share of the available RAM a GPU run's cpu tier may use when no cpu budget is given. The cpu tier is pinned
# (page-locked) memory: the kernel can neither swap nor reclaim it, and the driver needs memory of its own
# to map it. On the lent H200 host (125 GiB available) a run that pinned 87.5 GiB was OOM-killed.
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
    what `choose_policy` uses on a CPU when no cached profile exists, so no test pays for a benchmark."""
    ram = host_memory_bytes()
    return HardwareProfile(
        device_name=device_display_name(torch.device("cpu")), device_type="cpu",
        h2d_gib_s=8.0, d2h_gib_s=8.0, disk_read_gib_s=1.0, disk_write_gib_s=0.5,
        gpu_tflops_bf16=0.2, gpu_mem_gib_s=10.0, cpu_gflops=200.0, cpu_mem_gib_s=10.0,
        gpu_memory_bytes=ram, cpu_memory_bytes=ram, disk_free_bytes=0, layer_overhead_ms=0.2,
        hostname=socket.gethostname(), torch_version=torch.__version__, source="default",
    )


def cache_dir() -> Path:
    """`$LLMOPS_CACHE_DIR` or `~/.cache/llmops`."""
    env = os.environ.get("LLMOPS_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "llmops"


def profile_key(device: torch.device) -> dict[str, str]:
    """What identifies a machine's profile: hostname, device name, torch version."""
    return {"hostname": socket.gethostname(), "device_name": device_display_name(device),
            "torch_version": torch.__version__}


def profile_cache_path(device: torch.device, directory: Path | None = None) -> Path:
    key = profile_key(device)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (directory or cache_dir()) / f"hardware-{digest}.json"


def save_profile(profile: HardwareProfile, path: Path) -> None:
    """Write atomically: a temporary file in the same folder, fsync, rename into place."""
    write_json_atomic(path, {"version": PROFILE_VERSION, "profile": profile.to_dict()})


def load_profile(path: Path | str) -> HardwareProfile:
    """Read a profile JSON (the cache format `{"version", "profile"}` or a bare profile dict).
    Raises ValueError naming the file when it does not parse or a field is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"hardware profile {path}: cannot read JSON ({exc})") from exc
    if isinstance(data, dict) and "profile" in data:
        if data.get("version") not in range(1, PROFILE_VERSION + 1):
            raise ValueError(f"hardware profile {path}: version {data.get('version')!r}, "
                             f"expected {PROFILE_VERSION}")
        data = data["profile"]
    if not isinstance(data, dict):
        raise ValueError(f"hardware profile {path}: expected a JSON object")
    try:
        return HardwareProfile.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"hardware profile {path}: {exc}") from exc


def load_cached_profile(device: torch.device, directory: Path | None = None) -> HardwareProfile | None:
    """The cached profile of this machine and device, or None when absent, corrupt or for another key."""
    path = profile_cache_path(device, directory)
    if not path.exists():
        return None
    try:
        profile = load_profile(path)
    except ValueError:
        return None
    key = profile_key(device)
    if any(getattr(profile, k) != v for k, v in key.items()):
        return None
    if profile.source == "measured" and not (profile.slot_decode_ms and profile.slot_off_cache_ms):
        return None                      # measured before the executor probes existed: measure again
    return profile


def load_or_measure(
    device: torch.device | str | None = None,
    *,
    directory: Path | None = None,
    refresh: bool = False,
    measure_fn: Callable[..., HardwareProfile] | None = None,
    **measure_kwargs: Any,
) -> HardwareProfile:
    """This machine's profile: the cached one when valid, else measured (under a minute) and cached.

    `refresh` re-measures even when a valid cache exists. A corrupt or mismatched cache file is replaced.
    `measure_fn` (default `engine.policy.measure.measure`) is called as `measure_fn(device, **measure_kwargs)`.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not refresh:
        cached = load_cached_profile(device, directory)
        if cached is not None:
            return cached
    if measure_fn is None:
        from engine.policy.measure import measure as measure_fn
    profile = measure_fn(device, **measure_kwargs)
    save_profile(profile, profile_cache_path(device, directory))
    return profile
