"""`first_use_check`: run an optional fused kernel's self-check once, falling back (loudly) when it fails.

The fused kernels (Triton, imported only on a device's first call) are optional: without Triton the engine
uses its torch ops silently; with a broken toolchain or a kernel that disagrees with the torch ops it warns
once and uses them too. Each caller caches the answer per device (`functools.lru_cache`).
"""
from __future__ import annotations

import warnings
from typing import Callable


def first_use_check(what: str, device: str, check: Callable[[], bool]) -> bool:
    """check() (which imports the kernel's module, compiles it and compares it with the torch ops on a small
    input), or False: silently when the import fails (no Triton), with a RuntimeWarning naming `what` and
    `device` on any other exception (a broken toolchain must not stop inference)."""
    try:
        return check()
    except ImportError:
        return False
    except Exception as exc:
        warnings.warn(f"{what}: the Triton kernel failed on {device} ({exc!r}); using torch ops",
                      RuntimeWarning, stacklevel=4)
        return False
