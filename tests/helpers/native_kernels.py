"""A C kernel build that fails, for the fallback tests of engine.util.native's callers."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import pytest

from engine.util import native


@contextlib.contextmanager
def failing_build(monkeypatch: pytest.MonkeyPatch, cached: Callable) -> Iterator[None]:
    """Every `build_library` raises a compiler's RuntimeError while inside; `cached` (a kernel module's
    lru_cached loader) is cleared on entry and on exit, so the failure is met once and forgotten after."""
    def broken(*args, **kwargs):
        raise RuntimeError("cc could not build the kernel: error")
    monkeypatch.setattr(native, "build_library", broken)
    cached.cache_clear()
    try:
        yield
    finally:
        monkeypatch.undo()
        cached.cache_clear()
