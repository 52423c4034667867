"""How this CPU holds and multiplies weights: the floating dtype `dtype="auto"` means, and up to how many
rows the int4 kernel beats a dense GEMM over the same 4-bit weights; measured once per machine, cached on disk.

bf16 is not always faster on a CPU: it depends on the ISA (AVX512-BF16/AMX) and on the kernels the torch
build dispatches to. The engine multiplies bf16 matrices packed once into oneDNN's layout
(`engine.models.cpu_linear`), so that is the form timed against float32's MKL GEMM here; `F.linear` on a bf16
matrix reorders it on every call and lost to float32 (~3x on a 2-core x86 machine, torch 2.13 CPU wheel),
while on a 16-core H200 host bf16 is ~2.3x faster. The int4 crossing (`int4_max_rows`) is where
`_weight_int4pack_mm_for_cpu` stops beating dequantize + GEMM as rows grow (`Int4Linear` runs the kernel
up to it: a decode step, not a prefill); `int4_dense_max_rows` is where it stops beating a GEMM over a dense
copy packed once (`Policy.cpu_dense_copy`), timed over more matrices than the caches hold, as a decode step
reads a model's weights (a GEMM whose matrix stays in cache reads bfloat16's four times the bytes for free),
the first time a run holding dense copies asks for it (`machine_dense_rows`). So "auto" asks the machine,
but only once: the dtype is part of the result-cache key and bf16 and fp32 give different outputs, so a
choice re-timed in every process (a near tie flips with the load of the moment) would make an unchanged rerun
miss the cache and change its answers.

The answers live beside the hardware profile (`engine.util.paths.cache_dir()`, i.e. `$LLMOPS_CACHE_DIR`
or `~/.cache/llmops`) in `cpu-dtype-<digest>.json`, keyed by hostname + CPU model + torch version (the
things that decide which kernels run). It is written to a temporary name and renamed into place, under a
lock file so that two processes starting at once measure once and agree; a file that does not parse, names
an unknown dtype or holds another key is measured again and replaced, never used. Delete the file to
re-measure (e.g. after moving a disk image to another CPU of the same model name).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import platform
import socket
import time
from pathlib import Path
from typing import Any

import torch

from engine.calibrate.measure import best_seconds
from engine.models.cpu_linear import (INT4_DENSE_MAX_ROWS, INT4_MAX_ROWS, dense_copy, linear, onednn_bf16,
                                      pack_int4, pack_onednn)
from engine.quant.config import QuantConfig
from engine.quant.group import dequantize, quantize
from engine.storage.atomic import write_json_atomic
from engine.util.paths import cache_dir, locked

_SHAPE = (256, 576, 1536)   # a decode-sized GEMM (m, k, n): rows x hidden -> MLP width
_INT4_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)   # row counts the int4 kernel is timed at
_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
_NAMES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_CPU = torch.device("cpu")
CACHE_VERSION = 3


@dataclasses.dataclass(frozen=True)
class CpuChoice:
    """This machine's answers: the dtype "auto" means, and the rows up to which the int4 kernel runs, against
    dequantize + GEMM and against a packed dense copy's GEMM (None until a run holding dense copies asks:
    `machine_dense_rows`)."""

    dtype: torch.dtype
    int4_max_rows: int = INT4_MAX_ROWS
    int4_dense_max_rows: int | None = None


def _gemm_seconds(dtype: torch.dtype, repeats: int = 3) -> float:
    """One [m, k] x [k, n] product in `dtype`, bf16 in the packed form the engine multiplies."""
    m, k, n = _SHAPE
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dtype)  # [m, k]
    b = torch.randn(n, k, generator=gen).to(dtype)  # [n, k]
    if dtype == torch.bfloat16 and onednn_bf16():
        b = pack_onednn(b)
    return best_seconds(lambda: linear(a, b), _CPU, repeats)  # [m, n]


def measure_int4_rows(repeats: int = 3) -> int:
    """The most rows (of `_INT4_ROWS`) at which the int4 kernel multiplies a [k, n] 4-bit matrix faster than
    dequantizing it and multiplying dense (1 when it never is: a decode step of one row still saves the
    dequantization of every matrix)."""
    _, k, n = _SHAPE
    gen = torch.Generator().manual_seed(0)
    q = quantize((0.05 * torch.randn(n, k, generator=gen)).bfloat16(), QuantConfig(group_size=32))
    packed = pack_int4(q, max_rows=_INT4_ROWS[-1])          # the kernel at every row count timed
    best = 1
    for rows in _INT4_ROWS:
        x = torch.randn(rows, k, generator=gen).bfloat16()
        kernel = best_seconds(lambda: packed(x), _CPU, repeats)
        dense = best_seconds(lambda: torch.nn.functional.linear(x, dequantize(q)), _CPU, repeats)
        if kernel >= dense:
            break
        best = rows
    return best


def cold_bytes() -> int:
    """Bytes of weights no cache of this CPU holds: twice its largest cache (sysfs; 64 MiB when it lists
    none), at least 64 MiB and at most 1 GiB."""
    sizes = []
    for f in _CACHES.glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = f.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
    return min(max(2 * max(sizes, default=0), 64 << 20), 1 << 30)


def measure_int4_dense_rows(repeats: int = 3, cold: int | None = None) -> int:
    """The most rows (of `_INT4_ROWS`) at which the int4 kernel multiplies faster than a GEMM over the same
    weights' dense copy packed once (`dense_copy`), each timed over one product with each of as many
    [k, n] matrices as `cold` bytes of bfloat16 hold (default `cold_bytes()`), so neither form reads its
    weights from a cache (1 when the kernel never is faster)."""
    _, k, n = _SHAPE
    gen = torch.Generator().manual_seed(0)
    q = quantize((0.05 * torch.randn(n, k, generator=gen)).bfloat16(), QuantConfig(group_size=32))
    count = max(1, (cold or cold_bytes()) // (2 * n * k))
    packed = [pack_int4(q, max_rows=_INT4_ROWS[-1]) for _ in range(count)]     # the kernel at every row count
    dense = [dense_copy(q) for _ in range(count)]
    best = 1
    for rows in _INT4_ROWS:
        x = torch.randn(rows, k, generator=gen).bfloat16()
        kernel = best_seconds(lambda: [p(x) for p in packed], _CPU, repeats)
        gemm = best_seconds(lambda: [linear(x, d) for d in dense], _CPU, repeats)
        if kernel >= gemm:
            break
        best = rows
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
    """`<directory or cache_dir()>/cpu-dtype-<sha256 of machine_key()[:16]>.json`."""
    digest = hashlib.sha256(json.dumps(machine_key(), sort_keys=True).encode()).hexdigest()[:16]
    return (directory or cache_dir()) / f"cpu-dtype-{digest}.json"


def read_choice(path: Path) -> CpuChoice | None:
    """The answers stored at `path` for this machine, or None when absent, corrupt or for another key."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or data.get("key") != machine_key():
        return None
    dtype, rows, dense = _NAMES.get(data.get("dtype")), data.get("int4_max_rows"), data.get("int4_dense_max_rows")
    if dtype is None or not _whole_rows(rows) or not (dense is None or _whole_rows(dense)):
        return None
    return CpuChoice(dtype, rows, dense)


def _whole_rows(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _write(path: Path, choice: CpuChoice, seconds: dict[str, float]) -> None:
    """Atomically: a temporary file in the same folder, fsync, rename into place."""
    payload = {"version": CACHE_VERSION, "key": machine_key(), "dtype": str(choice.dtype).removeprefix("torch."),
               "int4_max_rows": choice.int4_max_rows, "int4_dense_max_rows": choice.int4_dense_max_rows,
               "seconds": seconds,
               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json_atomic(path, payload)


def _measure() -> tuple[CpuChoice, dict[str, float]]:
    dtype, seconds = measure_cpu_dtype()
    return CpuChoice(dtype, measure_int4_rows()), seconds


def machine_cpu_choice(directory: Path | None = None) -> CpuChoice:
    """This machine's answers: the cached ones when valid, else measured now and cached (see module doc).
    When the cache folder cannot be written, the measurement is used for this process only."""
    path = cache_path(directory)
    cached = read_choice(path)
    if cached is not None:
        return cached
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path):
            cached = read_choice(path)          # another process may have measured while we waited
            if cached is not None:
                return cached
            choice, seconds = _measure()
            _write(path, choice, seconds)
            return choice
    except OSError:
        return _measure()[0]


def machine_dense_rows(directory: Path | None = None) -> int:
    """This machine's `int4_dense_max_rows`: the cached one, else measured now (only a run holding dense copies
    asks: the measurement reads more matrices than the CPU's caches hold) and added to the cached answers.
    `INT4_DENSE_MAX_ROWS` where no bfloat16 oneDNN matmul runs (no dense copy is packed there)."""
    choice = machine_cpu_choice(directory)
    if choice.int4_dense_max_rows is not None:
        return choice.int4_dense_max_rows
    if not onednn_bf16():
        return INT4_DENSE_MAX_ROWS
    path = cache_path(directory)
    try:
        with locked(path):
            cached = read_choice(path) or choice
            if cached.int4_dense_max_rows is not None:
                return cached.int4_dense_max_rows
            rows = measure_int4_dense_rows()
            _write(path, dataclasses.replace(cached, int4_dense_max_rows=rows), _stored_seconds(path))
            return rows
    except OSError:
        return measure_int4_dense_rows()


def _stored_seconds(path: Path) -> dict[str, float]:
    """The dtype measurement's seconds stored at `path` ({} when unreadable)."""
    with contextlib.suppress(OSError, ValueError, UnicodeDecodeError):
        seconds = json.loads(path.read_text(encoding="utf-8")).get("seconds")
        if isinstance(seconds, dict):
            return seconds
    return {}


def machine_cpu_dtype(directory: Path | None = None) -> torch.dtype:
    """This machine's dtype for "auto" (`machine_cpu_choice`)."""
    return machine_cpu_choice(directory).dtype


@functools.lru_cache(maxsize=1)
def this_machine() -> CpuChoice:
    """`machine_cpu_choice` for the default cache folder, remembered for the process."""
    return machine_cpu_choice()


def fastest_cpu_dtype() -> torch.dtype:
    """bfloat16 when a bf16 GEMM beats float32 on this CPU by 10% or more, else float32 (`this_machine`)."""
    return this_machine().dtype


def int4_max_rows() -> int:
    """The rows up to which this CPU's int4 kernel beats dequantize + a dense GEMM (`this_machine`)."""
    return this_machine().int4_max_rows


@functools.lru_cache(maxsize=1)
def int4_dense_max_rows() -> int:
    """The rows up to which this CPU's int4 kernel beats a GEMM over a packed dense copy (`machine_dense_rows`
    for the default cache folder, remembered for the process)."""
    return machine_dense_rows()
