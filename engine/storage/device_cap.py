"""The hard cap behind `gpu_memory`: torch's caching allocator limited to the budget on that device.

The executor counts its own buffers against the budget, but planning (trials on truncated copies), warm-up
and a block's temporaries are allocated by torch directly. Capping the allocator
(`torch.cuda.set_per_process_memory_fraction`) makes the budget hold for all of it: an allocation past the
cap frees torch's cached blocks and, failing that, raises `torch.OutOfMemoryError`, which the engine turns
into a smaller GPU batch (a block) or a rejected candidate (a trial). The cap is per process and per
device: with several engines on one device it is the largest budget among them, and none while an engine
without a budget is alive. Owners register with `hold` and give the budget back with the returned handle.
"""
from __future__ import annotations

import itertools
import threading

import torch

_LOCK = threading.Lock()
_IDS = itertools.count()
_HELD: dict[int, dict[int, int | None]] = {}   # device index -> {holder id: budget bytes, None = unbounded}


def _apply(index: int) -> None:
    budgets = list(_HELD.get(index, {}).values())
    total = torch.cuda.get_device_properties(index).total_memory
    cap = None if not budgets or None in budgets else max(budgets)
    torch.cuda.set_per_process_memory_fraction(1.0 if cap is None else min(1.0, cap / total), index)


def hold(device: torch.device, budget: int | None) -> int | None:
    """Register an engine's `budget` (bytes, None = unbounded) on `device` and re-apply the cap; returns
    the handle for `release`, or None on a device without a caching allocator to cap (the CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _LOCK:
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
