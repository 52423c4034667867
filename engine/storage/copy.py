"""The one copy function: moves a stored value (dense or `QTensor`) between any two tiers.

Tiers map to memory kinds: gpu = the compute device, cpu = host RAM (pinned with a GPU), disk = memory-mapped
host views of files. So every copy is a torch `copy_` between two same-shaped values; what differs is when
it is complete (see `copy`). A disk -> GPU copy goes through a pinned `relay` buffer.
"""
from __future__ import annotations

from typing import Sequence

import torch

from engine.quant.qtensor import QTensor
from engine.storage.pitched import prefix_copy
from engine.storage.tiers import Stored

_ALL = slice(None)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape


def copy(dst: Stored, src: Stored, *, stream: "torch.cuda.Stream | None" = None,
         relay: Stored | None = None, after: "Sequence[torch.cuda.Event] | None" = None,
         first: tuple[int, int] | None = None) -> "torch.cuda.Event | None":
    """Copy `src` into `dst` (same logical shape and kind: both dense or both QTensor with equal layout).
    `first` = (dim, n): copy only indices [0, n) of that leading dim (a KV home's written positions); a
    host <-> device one is a single pitched copy per tensor (`engine.storage.pitched`).

    Completion: when neither side is on a CUDA device, the copy is complete when this returns (it runs in
    the calling thread: call it from a worker thread to overlap disk reads). When either side is on CUDA,
    the copy is enqueued on `stream` (the current stream if None) after that stream waits for the current
    stream (with `after`: for those events only, the caller's proof that nothing issued since still reads
    `dst`), and an event recorded after it is returned: the copy is complete when that event is; wait with
    `torch.cuda.current_stream().wait_event(ev)` before using `dst` on the compute stream, or
    `ev.synchronize()` before reading a host `dst` on the host. Device tensors are recorded on `stream`, so
    dropping them after the call is safe. A host `src` that is not pinned (disk) is
    first copied into the pinned `relay` (same shape as src) in the calling thread, so the transfer itself
    stays asynchronous. Aliased dst/src (same memory) is a no-op.
    """
    dst_parts = dst.parts() if isinstance(dst, QTensor) else (dst,)
    src_parts = src.parts() if isinstance(src, QTensor) else (src,)
    if isinstance(dst, QTensor) != isinstance(src, QTensor):
        raise TypeError(f"copy: cannot copy {type(src).__name__} into {type(dst).__name__}")
    cuda = any(t.is_cuda for t in (*dst_parts, *src_parts))
    cut = _ALL if first is None else (_ALL,) * first[0] + (slice(0, first[1]),)
    if not cuda:
        for d, s in zip(dst_parts, src_parts):
            if not _same(d, s):
                d[cut].copy_(s[cut])
        return None
    if relay is not None:
        relay_parts = relay.parts() if isinstance(relay, QTensor) else (relay,)
        for r, s in zip(relay_parts, src_parts):
            r[cut].copy_(s[cut])
        src_parts = relay_parts
    current = torch.cuda.current_stream()
    stream = stream or current
    if after is None:
        stream.wait_stream(current)
    else:
        for event in after:
            stream.wait_event(event)
    with torch.cuda.stream(stream):
        for d, s in zip(dst_parts, src_parts):
            if not _same(d, s):
                if first is None:
                    d.copy_(s, non_blocking=True)
                else:
                    prefix_copy(d, s, first[1], first[0], stream)
                for t in (d, s):
                    if t.is_cuda and stream != current:
                        t.record_stream(stream)             # the allocator must not reuse it before the copy
        event = torch.cuda.Event()
        event.record(stream)
    return event
