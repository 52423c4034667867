"""The hard cap behind `gpu_memory`: torch's caching allocator limited to the budget on that device.

The executor counts its own buffers against the budget, but planning (trials on truncated copies), warm-up
and a block's temporaries are allocated by torch directly. Capping the allocator
(`torch.cuda.set_per_process_memory_fraction`) makes the budget hold for all of it: an allocation past the
cap frees torch's cached blocks and, failing that, raises `torch.OutOfMemoryError`, which the engine turns
into a smaller GPU batch (a block) or a rejected candidate (a trial). The cap is per process and per
device: with several engines on one device it is the largest budget among them, and none while an engine
without a budget is alive. Owners register with `hold` and give the budget back with the returned handle.

The cap counts reserved memory, so fragmentation can break a plan that fits: on an H200, Mixtral-8x7B at
prompt 512 and 512 rows per GPU batch fails under 16 GiB with 2.04 GiB reserved but unallocated in pieces
smaller than the 2 GiB hidden state it asks for, and runs (peak 15.6 GiB allocated) with torch's expandable
segments. The first `hold` on a CUDA device therefore turns expandable segments on for the process, unless
the user's allocator configuration ($PYTORCH_CUDA_ALLOC_CONF or $PYTORCH_ALLOC_CONF) says anything about
them; its cached free segments are given back then, and segments in use stay as they were.
"""
from __future__ import annotations

import itertools
import os
import threading
import warnings
from typing import Mapping

import torch

_LOCK = threading.Lock()
_IDS = itertools.count()
_HELD: dict[int, dict[int, int | None]] = {}   # device index -> {holder id: budget bytes, None = unbounded}
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_segments_done = False                          # expandable segments decided for this process


def wants_expandable_segments(environ: Mapping[str, str]) -> bool:
    """True unless the allocator configuration in `environ` mentions expandable_segments (the user's choice,
    either way, is kept)."""
    return not any("expandable_segments" in environ.get(name, "") for name in ALLOC_CONF_VARS)


def allocator_setter():
    """torch's run-time allocator settings call: the accelerator-wide one where torch has it (2.11+, whose
    CUDA-only `torch.cuda.memory._set_allocator_settings` warns that it is deprecated), else the CUDA one."""
    return getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings


def _expandable_segments() -> None:
    """Once per process: expandable segments on, when `wants_expandable_segments(os.environ)`; a torch that
    cannot set them at run time is warned about once (the cap still holds; fragmentation is then possible)."""
    global _segments_done
    if _segments_done:
        return
    _segments_done = True
    if not wants_expandable_segments(os.environ):
        return
    try:
        allocator_setter()("expandable_segments:True")
        torch.cuda.empty_cache()        # cached fixed segments go back, so new memory comes in expandable ones
    except (AttributeError, RuntimeError) as err:
        warnings.warn(f"device_cap: could not turn on torch's expandable segments ({err}); the gpu_memory cap "
                      f"still holds, but fragmentation can make a fitting plan run out of memory "
                      f"(set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting)", stacklevel=3)


def _apply(index: int) -> None:
    budgets = list(_HELD.get(index, {}).values())
    total = torch.cuda.get_device_properties(index).total_memory
    cap = None if not budgets or None in budgets else max(budgets)
    torch.cuda.set_per_process_memory_fraction(1.0 if cap is None else min(1.0, cap / total), index)


def hold(device: torch.device, budget: int | None) -> int | None:
    """Register an engine's `budget` (bytes, None = unbounded) on `device` and re-apply the cap (the first
    call of the process also decides expandable segments, see the module doc); returns the handle for
    `release`, or None on a device without a caching allocator to cap (the CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _LOCK:
        _expandable_segments()
        handle = next(_IDS)
        _HELD.setdefault(index, {})[handle] = budget
        _apply(index)
    return handle


def release(handle: int | None) -> None:
    """Give back the budget `hold` registered (no-op for None or a handle already released)."""
    if handle is None:
        return
    with _LOCK:
        for index, held in _HELD.items():
            if held.pop(handle, "gone") != "gone":
                _apply(index)
                return


def cap_bytes(device: torch.device) -> int | None:
    """The cap now applied on `device` (None: uncapped or not a CUDA device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _LOCK:
        budgets = list(_HELD.get(index, {}).values())
    return None if not budgets or None in budgets else max(budgets)
