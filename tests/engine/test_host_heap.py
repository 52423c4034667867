"""`engine.util.host_heap.reserve_huge_heap`: a CPU run's heap on transparent huge pages (Linux with glibc)."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from engine.util import host_heap

_GLIBC_LINUX = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

_PROBE = """
from engine.util.host_heap import RESERVE_BYTES, heap_range, reserve_huge_heap
assert reserve_huge_heap() and reserve_huge_heap()          # once per process, the same answer after
start, end = heap_range()
assert end - start >= RESERVE_BYTES, end - start
advised = 0                                                  # bytes of heap flagged hg: MADV_HUGEPAGE
with open("/proc/self/smaps") as smaps:
    span = None
    for line in smaps:
        if "-" in line.split(" ")[0] and not line.startswith("VmFlags"):
            a, b = (int(x, 16) for x in line.split()[0].split("-"))
            span = b - a if line.rstrip().endswith("[heap]") else None
        elif span is not None and line.startswith("VmFlags:") and "hg" in line.split()[1:]:
            advised += span
assert advised >= RESERVE_BYTES, advised
print("ok")
"""


@pytest.mark.skipif(not _GLIBC_LINUX, reason="the heap is only reserved on Linux with glibc")
def test_the_heap_grows_and_is_advised_huge_pages():
    """In a process of its own (the settings are process-wide): the heap spans the reserve and carries the
    huge-page advice."""
    run = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_nothing_changes_off_glibc(monkeypatch):
    monkeypatch.setattr(host_heap.platform, "system", lambda: "Darwin")
    assert host_heap.reserve_huge_heap.__wrapped__() is False
