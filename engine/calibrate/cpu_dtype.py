"""Which floating dtype `dtype="auto"` means on this CPU: measured once per machine and cached on disk.

bf16 is not always faster on a CPU: it depends on the ISA (AVX512-BF16/AMX) and on the kernels the torch
build dispatches to. On a 2-core x86 machine (torch 2.13 CPU wheel) a bf16 GEMM runs ~3x slower than fp32;
on a 16-core H200 host bf16 is ~2.3x faster. So "auto" asks the machine, but only once: the
dtype is part of the result-cache key and bf16 and fp32 give different outputs, so a choice re-timed in every
process (a near tie flips with the load of the moment) would make an unchanged rerun miss the cache and
change its answers.

The answer lives beside the hardware profile (`engine.calibrate.machine.cache_dir()`, i.e. `$LLMOPS_CACHE_DIR`
or `~/.cache/llmops`) in `cpu-dtype-<digest>.json`, keyed by hostname + CPU model + torch version (the
things that decide which kernels run). It is written to a temporary name and renamed into place, under a
lock file so that two processes starting at once measure once and agree; a file that does not parse, names
an unknown dtype or holds another key is measured again and replaced, never used. Delete the file to
re-measure (e.g. after moving a disk image to another CPU of the same model name).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import platform
import socket
import time
from pathlib import Path
from typing import Iterator

import torch

from engine.calibrate.machine import cache_dir
from engine.storage.atomic import write_json_atomic

_SHAPE = (256, 576, 1536)   # a decode-sized GEMM (m, k, n): rows x hidden -> MLP width
_NAMES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
CACHE_VERSION = 1


def _gemm_seconds(dtype: torch.dtype, repeats: int = 3) -> float:
    m, k, n = _SHAPE
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dtype)  # [m, k]
    b = torch.randn(n, k, generator=gen).to(dtype)  # [n, k]
    torch.nn.functional.linear(a, b)  # warm-up: kernel selection, packing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(a, b)  # [m, n]
        best = min(best, time.perf_counter() - start)
    return best


def measure_cpu_dtype() -> tuple[torch.dtype, dict[str, float]]:
    """Time both GEMMs now (~10 ms): (bfloat16 when it beats float32 by 10% or more, else float32; the
    seconds of each)."""
    bf16, fp32 = _gemm_seconds(torch.bfloat16), _gemm_seconds(torch.float32)
    return (torch.bfloat16 if bf16 < 0.9 * fp32 else torch.float32), {"bfloat16_s": bf16, "float32_s": fp32}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's "model name", else platform.processor(), else the machine)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_key() -> dict[str, str]:
    """What the cached answer depends on: hostname, CPU model, torch version."""
    return {"hostname": socket.gethostname(), "cpu_model": cpu_model(), "torch_version": torch.__version__}


def cache_path(directory: Path | None = None) -> Path:
    """`<directory or machine.cache_dir()>/cpu-dtype-<sha256 of machine_key()[:16]>.json`."""
    digest = hashlib.sha256(json.dumps(machine_key(), sort_keys=True).encode()).hexdigest()[:16]
    return (directory or cache_dir()) / f"cpu-dtype-{digest}.json"


def read_cached(path: Path) -> torch.dtype | None:
    """The dtype stored at `path` for this machine, or None when absent, corrupt or for another key."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or data.get("key") != machine_key():
        return None
    return _NAMES.get(data.get("dtype"))


def _write(path: Path, dtype: torch.dtype, seconds: dict[str, float]) -> None:
    """Atomically: a temporary file in the same folder, fsync, rename into place."""
    payload = {"version": CACHE_VERSION, "key": machine_key(), "dtype": str(dtype).removeprefix("torch."),
               "seconds": seconds, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json_atomic(path, payload)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` + ".lock" (waits for another process measuring now)."""
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def machine_cpu_dtype(directory: Path | None = None) -> torch.dtype:
    """This machine's answer: the cached one when valid, else measured now and cached (see module doc).
    When the cache folder cannot be written, the measurement is used for this process only."""
    path = cache_path(directory)
    cached = read_cached(path)
    if cached is not None:
        return cached
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            cached = read_cached(path)          # another process may have measured while we waited
            if cached is not None:
                return cached
            dtype, seconds = measure_cpu_dtype()
            _write(path, dtype, seconds)
            return dtype
    except OSError:
        return measure_cpu_dtype()[0]


@functools.lru_cache(maxsize=1)
def fastest_cpu_dtype() -> torch.dtype:
    """bfloat16 when a bf16 GEMM beats float32 on this CPU by 10% or more, else float32: measured once per
    machine (`machine_cpu_dtype`), then read from the cache file; remembered for the process."""
    return machine_cpu_dtype()
