"""Torch-side helpers of the harnesses: the device to run on, peak device memory, giving an executor's memory
back, a torch.profiler summary, and a dummy preset cut to its first layers. Torch is imported inside each
function, so a harness without GPU work can import the rest of `benchmarks.common` without it."""
from __future__ import annotations

from typing import Any

from benchmarks.common.machine import GIB, cuda_available

SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync")


def torch_device(name: str = "auto") -> Any:
    """`torch.device` for "auto" (cuda when there is one, else cpu), "cpu", "cuda", "cuda:1"..."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def reset_peak(devices: int = 1) -> None:
    """Reset torch's peak-memory counters on the first `devices` GPUs (no-op without one)."""
    if cuda_available():
        import torch

        for index in range(devices):
            torch.cuda.synchronize(index)
            torch.cuda.reset_peak_memory_stats(index)


def peak_gib(devices: int = 1) -> dict[str, Any]:
    """{"peak_device_gib": max allocated, "peak_reserved_gib": max reserved} since the last reset, the
    largest over the first `devices` GPUs (with several, also "peak_device_gib_per_gpu"); None on CPU."""
    if not cuda_available():
        return {"peak_device_gib": None, "peak_reserved_gib": None}
    import torch

    allocated, reserved = [], []
    for index in range(devices):
        torch.cuda.synchronize(index)
        allocated.append(round(torch.cuda.max_memory_allocated(index) / GIB, 3))
        reserved.append(round(torch.cuda.max_memory_reserved(index) / GIB, 3))
    out: dict[str, Any] = {"peak_device_gib": max(allocated), "peak_reserved_gib": max(reserved)}
    if devices > 1:
        out["peak_device_gib_per_gpu"] = allocated
    return out


def close_and_release(engine: Any) -> None:
    """Close `engine` (an executor or a set of them; None: nothing opened) and give its memory back."""
    if engine is not None:
        engine.close()
    release_memory()


def release_memory() -> None:
    """Give a closed executor's memory back: device blocks and the pinned host blocks torch caches."""
    import gc

    gc.collect()
    if cuda_available():
        import torch

        torch.cuda.empty_cache()
        empty_host_cache()


def empty_host_cache() -> None:
    """Give the pinned host blocks torch's allocator caches back to the system (whichever name this torch has)."""
    import torch

    for fn in (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None),
               getattr(torch._C, "_host_emptyCache", None)):
        if fn is not None:
            fn()
            return


def trace_summary(prof: Any, wall_s: float, rows: int = 15) -> dict[str, Any]:
    """What a `torch.profiler.profile` of `wall_s` seconds says about where the time went: the device's
    kernel seconds and copy seconds (its own events, each counted once), the kernels' fraction of the wall
    (below 1: the device waited for the host), the host-side synchronizing calls and their seconds, the
    kernels launched, and the top ops by device and by host time (tables)."""
    from torch.autograd import DeviceType

    device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    copy_s = sum(e.device_time_total for e in device if e.name.startswith(("Memcpy", "Memset"))) / 1e6
    kernel_s = sum(e.device_time_total for e in device) / 1e6 - copy_s
    averages = prof.key_averages()
    syncs = {e.key: {"calls": e.count, "host_s": e.cpu_time_total / 1e6} for e in averages if e.key in SYNC_CALLS}
    launches = sum(e.count for e in averages if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC"))
    return {"wall_s": wall_s, "kernel_s": kernel_s, "copy_s": copy_s,
            "kernel_fraction": kernel_s / wall_s if wall_s else None, "kernel_launches": launches,
            "sync_calls": syncs,
            "by_device_time": averages.table(sort_by="self_cuda_time_total", row_limit=rows),
            "by_host_time": averages.table(sort_by="self_cpu_time_total", row_limit=rows)}


def with_layers(loaded: Any, layers: int) -> Any:
    """A dummy preset's model cut to its first `layers` decoder layers (the same shapes and weights per
    layer): per-layer costs measured at a fraction of the full model's placement time."""
    import dataclasses

    from engine.models.registry import build_family

    config = dataclasses.replace(loaded.config, num_hidden_layers=layers)
    return dataclasses.replace(loaded, config=config, family=build_family(config),
                               fingerprint=f"{loaded.fingerprint}-{layers}L")
