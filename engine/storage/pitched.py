"""Pitched (2-D) copies between pinned host memory and a CUDA device: the first n positions of every row.

A KV-cache home is [b, h, S, *x] with S every position the block will hold; a decode step needs only the
positions written so far, [0, n). That slice is b*h runs of n*x elements, each S*x elements apart: torch's
`copy_` of such a strided host <-> device slice stages it through a contiguous temporary on the CPU (a
host-side gather as slow as the link), so the copy is issued as one `cudaMemcpy2DAsync` (rows b*h, width n*x
bytes, each side at its own pitch, S*x bytes for a whole home) on the CUDA runtime torch itself loaded.
A home held positions-major (memory [b, S, h, *x], seen as [b, h, S, *x]: `engine.runtime.kv_cache`) is read
in memory order: b runs of n*h*x elements, S*h*x apart, so each run is h times longer.
`prefix_copy` falls back to a torch copy of the slices where that runtime is not found or a tensor's layout
is not rows of runs; every caller still gets a correct copy, and `pitched_available()` says which path runs.
"""
from __future__ import annotations

import ctypes
import functools
import math

import torch

_HOST_TO_DEVICE, _DEVICE_TO_HOST = 1, 2          # cudaMemcpyKind


@functools.lru_cache(maxsize=1)
def _cudart() -> "ctypes.CDLL | None":
    """The CUDA runtime library already mapped into this process by torch (None without one)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line and "/" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            fn = lib.cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        return lib
    return None


def pitched_available() -> bool:
    """True when `prefix_copy` issues host <-> device copies as single pitched copies."""
    return _cudart() is not None


def _rows_of_runs(t: torch.Tensor, dim: int) -> tuple[int, int] | None:
    """(rows, pitch in elements) when `t` is contiguous from `dim` on and its dims before `dim` merge into one
    dim of rows a constant pitch apart; else None."""
    span = 1
    for d in range(t.dim() - 1, dim - 1, -1):
        if t.shape[d] != 1 and t.stride(d) != span:
            return None
        span *= t.shape[d]
    lead = [(t.shape[d], t.stride(d)) for d in range(dim) if t.shape[d] != 1]
    if not lead:
        return 1, span
    for (_, stride), (size, inner) in zip(lead, lead[1:]):
        if stride != inner * size:
            return None
    pitch = lead[-1][1]
    return (math.prod(t.shape[:dim]), pitch) if pitch >= span else None


def _memory_order(t: torch.Tensor, dim: int) -> list[int]:
    """t's dims from the largest stride to the smallest (ties in dim order), its size-1 dims other than `dim`
    last: the order in which its elements lie in memory."""
    return sorted(range(t.dim()), key=lambda d: (1, d) if t.shape[d] == 1 and d != dim else (-t.stride(d), d))


def _pitched_plan(dst: torch.Tensor, src: torch.Tensor, n: int, dim: int) -> tuple[int, int, int, int] | None:
    """`prefix_copy`'s one 2-D copy as (rows, dst pitch, src pitch, width), the last three in bytes: both
    tensors read in src's memory order (`_memory_order`), where positions [0, n) of `dim` and every dim after it
    form one run per row; None when either tensor is not rows of runs in that order."""
    order = _memory_order(src, dim)
    mdim = order.index(dim)
    mdst, msrc = dst.permute(order), src.permute(order)                    # [rows..., dim, run...]
    d_layout, s_layout = _rows_of_runs(mdst, mdim), _rows_of_runs(msrc, mdim)
    if d_layout is None or s_layout is None:
        return None
    (rows, d_pitch), (_, s_pitch) = d_layout, s_layout
    es = dst.element_size()
    return rows, d_pitch * es, s_pitch * es, n * math.prod(mdst.shape[mdim + 1:]) * es


def prefix_copy(dst: torch.Tensor, src: torch.Tensor, n: int, dim: int, stream: "torch.cuda.Stream") -> None:
    """dst[..., :n, ...] = src[..., :n, ...] along `dim`, enqueued on `stream` (call it inside
    `torch.cuda.stream(stream)`). dst and src have the same shape; one is on the CUDA device and the other in
    pinned host memory. Completion is the caller's (an event recorded on `stream` after it)."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"prefix_copy: {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}")
    if not 0 <= n <= dst.shape[dim]:
        raise ValueError(f"prefix_copy: {n} positions of a dim of {dst.shape[dim]}")
    if n == 0 or dst.numel() == 0:
        return
    lib, plan = _cudart(), _pitched_plan(dst, src, n, dim)
    if lib is None or plan is None or dst.is_cuda == src.is_cuda:
        index = (slice(None),) * dim + (slice(0, n),)
        dst[index].copy_(src[index], non_blocking=True)
        return
    rows, d_pitch, s_pitch, width = plan
    kind = _HOST_TO_DEVICE if dst.is_cuda else _DEVICE_TO_HOST
    err = lib.cudaMemcpy2DAsync(dst.data_ptr(), d_pitch, src.data_ptr(), s_pitch, width, rows, kind,
                                stream.cuda_stream)
    if err:
        raise RuntimeError(f"prefix_copy: cudaMemcpy2DAsync failed with CUDA error {err} "
                           f"(rows {rows}, width {width} B, pitches {d_pitch}/{s_pitch} B)")
