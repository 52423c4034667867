"""How the process pins host memory: page-locked after its pages are faulted in on several threads.

torch's pinned allocator calls `cudaHostAlloc` by default, which faults in and locks every page on the
calling thread: on an H200 host about 2.2 GB/s, so the second host cache of an OPT-30B ahead-prefill plan
(about 40 GB) takes 18 s inside its first block. With `pinned_use_cuda_host_register` torch instead
allocates pageable memory, touches its pages on `pinned_num_register_threads` threads and locks the range with
`cudaHostRegister`; the memory is pinned all the same (same transfer rate, `Tensor.is_pinned()` true).

`configure()` turns that on once per process, before the engine's first pinned pool (`HostPool` with pinning)
allocates, unless the user's allocator configuration ($PYTORCH_CUDA_ALLOC_CONF or $PYTORCH_ALLOC_CONF) says
anything about `pinned_use_cuda_host_register` or `pinned_num_register_threads` (their choice is kept). A torch
that cannot set it at run time is warned about once; pinning then stays torch's default.
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import Mapping

import torch

from engine.storage.device_cap import ALLOC_CONF_VARS, allocator_setter

_KEYS = ("pinned_use_cuda_host_register", "pinned_num_register_threads")
_MAX_THREADS = 16
_LOCK = threading.Lock()
_done = False


def register_threads(cpus: int) -> int:
    """Threads that fault pages in: the largest power of two at most `cpus` and `_MAX_THREADS` (torch wants a
    power of two), at least 1."""
    n = 1
    while n * 2 <= min(cpus, _MAX_THREADS):
        n *= 2
    return n


def settings(environ: Mapping[str, str], cpus: int) -> str | None:
    """The allocator settings `configure` applies, or None when `environ`'s allocator configuration already
    mentions pinned registration (the user's choice is kept)."""
    if any(key in environ.get(name, "") for name in ALLOC_CONF_VARS for key in _KEYS):
        return None
    return f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{register_threads(cpus)}"


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                      # not Linux
        return os.cpu_count() or 1


def configure() -> str | None:
    """Once per process, on a machine with CUDA: apply `settings(os.environ, usable cpus)`. Returns what was
    applied (None: nothing, already decided, no CUDA, the user's configuration, or a torch without the
    setting)."""
    global _done
    with _LOCK:
        if _done or not torch.cuda.is_available():
            return None
        _done = True
        wanted = settings(os.environ, _usable_cpus())
        if wanted is None:
            return None
        try:
            allocator_setter()(wanted)
        except (AttributeError, RuntimeError) as err:
            warnings.warn(f"pinning: could not set torch's pinned allocator to register pages on several threads "
                          f"({err}); pinning stays single-threaded", stacklevel=2)
            return None
        return wanted
