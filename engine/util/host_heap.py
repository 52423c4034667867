"""`reserve_huge_heap`: the process's heap on transparent huge pages, for runs whose compute device is the CPU
(Linux with glibc; elsewhere nothing changes).

A CPU decode step reads every weight matrix and every row's cache end to end and writes fresh activations. On
4 KiB pages that is a TLB miss every 4 KiB, and every 4 KiB a run touches first faults once. Where transparent
huge pages are `madvise` (the usual default), glibc's malloc never asks for them, and it maps each allocation
of 128 KiB or more on its own, so torch's weights, caches and large temporaries all live on 4 KiB pages.
`reserve_huge_heap`:

- serves allocations below `MMAP_THRESHOLD` from the heap instead of mappings of their own (M_MMAP_THRESHOLD);
- keeps up to `TRIM_THRESHOLD` of freed heap instead of returning it to the system (M_TRIM_THRESHOLD), so a
  freed buffer's pages serve the next one without faulting again;
- grows the heap by `RESERVE_BYTES` once (allocated and freed: address space, no resident memory) and advises
  the whole heap MADV_HUGEPAGE, so its pages fault in 2 MiB at a time on first touch.

What it costs: the settings are the process's (every later malloc is served so, which is why only CPU runs ask
for them), and up to `TRIM_THRESHOLD` of freed heap stays with the process. The effect on the CPU peers'
64-row batch: `benchmarks/records/cpu-2core/cpu_peers.jsonl`.
"""
from __future__ import annotations

import ctypes
import functools
import platform

HUGE_PAGE = 2 << 20                 # bytes of an x86-64 / arm64 transparent huge page
RESERVE_BYTES = 1536 << 20          # the heap grown and advised up front
TRIM_THRESHOLD = 2**31 - 1          # the freed heap kept (malloc's largest: its settings are C ints)
MMAP_THRESHOLD = 512 << 20          # allocations at least this large keep mappings of their own
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3     # <malloc.h>
_MADV_HUGEPAGE = 14                               # <asm-generic/mman-common.h>


def heap_range() -> tuple[int, int] | None:
    """[start, end) of this process's heap (its `[heap]` mappings: advice on part of it splits the mapping), None
    when it has none."""
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith("[heap]"):
                spans.append(tuple(int(x, 16) for x in line.split()[0].split("-")))
    return (min(s for s, _ in spans), max(e for _, e in spans)) if spans else None


@functools.cache
def reserve_huge_heap() -> bool:
    """Once per process: glibc's heap on transparent huge pages (module docstring). True when the heap is
    advised; False off Linux or glibc, or where glibc or the kernel refused (the process keeps whatever
    settings were taken: each is only a hint to the allocator)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.madvise.restype, libc.madvise.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if not (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return False
    held = [libc.malloc(MMAP_THRESHOLD // 2) for _ in range(RESERVE_BYTES // (MMAP_THRESHOLD // 2))]
    for pointer in held:
        if pointer:
            libc.free(pointer)
    heap = heap_range()
    if heap is None:
        return False
    start = -(-heap[0] // HUGE_PAGE) * HUGE_PAGE
    return heap[1] > start and libc.madvise(start, heap[1] - start, _MADV_HUGEPAGE) == 0
