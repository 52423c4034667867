"""Where the engine keeps what it measures and builds per machine, and how processes share one file there."""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator


def cache_dir() -> Path:
    """`$LLMOPS_CACHE_DIR` or `~/.cache/llmops`: hardware profiles, CPU choices, plans and built kernels."""
    env = os.environ.get("LLMOPS_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "llmops"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` + ".lock" (waits while another process holds it: one measures or
    builds, the others then read what it wrote)."""
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
