"""Host buffers for the cpu tier: pinned when a GPU exists, carved out of large pooled allocations.

torch's pinned allocator rounds each allocation up to a power of two (a 5 GiB tensor costs 8 GiB), so the
pool pins power-of-two chunks (1 GiB, or the next power of two for a bigger request) and hands out aligned
sub-views, first fit over every chunk's free ranges. `free(view)` gives a view's range back (merged with its
free neighbours), so a buffer that grows between blocks (a longer KV cache) reuses the space it leaves
instead of pinning more. Without CUDA, buffers are plain tensors. `close` drops every chunk. A pinning pool
first sets how the process pins (`engine.storage.pinning.configure`: pages faulted in on several threads).
"""
from __future__ import annotations

import torch

from engine.storage import pinning

_ALIGN = 512
_CHUNK = 1 << 30


class _Chunk:
    def __init__(self, nbytes: int, pin: bool):
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.free = [(0, nbytes)]                   # sorted, disjoint, never adjacent [start, end) ranges

    def take(self, nbytes: int) -> int | None:
        """Offset of a fresh range of `nbytes` (first fit), or None when no free range holds it."""
        for n, (start, end) in enumerate(self.free):
            if end - start >= nbytes:
                if end - start == nbytes:
                    del self.free[n]
                else:
                    self.free[n] = (start + nbytes, end)
                return start
        return None

    def give(self, start: int, nbytes: int) -> None:
        """Return [start, start + nbytes) to the free ranges, merged with its neighbours."""
        end = start + nbytes
        ranges = sorted(self.free + [(start, end)])
        merged = [ranges[0]]
        for a, b in ranges[1:]:
            if a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.free = merged


class HostPool:
    """`pooled` (default: `pin`) carves buffers out of chunks; unpooled, each buffer is a plain tensor."""

    def __init__(self, pin: bool, chunk_bytes: int = _CHUNK, pooled: bool | None = None):
        self.pin = pin
        if pin:
            pinning.configure()
        self.pooled = pin if pooled is None else pooled
        self.chunk_bytes = chunk_bytes
        self._chunks: list[_Chunk] = []
        self._taken: dict[int, tuple[_Chunk, int, int]] = {}    # view data_ptr -> (chunk, offset, bytes)
        self.reserved_bytes = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor of `shape` and `dtype` (pinned when the pool pins)."""
        numel = 1
        for d in shape:
            numel *= d
        if not self.pooled:
            return torch.empty(shape, dtype=dtype)
        size = numel * torch.empty((), dtype=dtype).element_size()
        nbytes = -(-size // _ALIGN) * _ALIGN
        for chunk in self._chunks:
            offset = chunk.take(nbytes)
            if offset is not None:
                break
        else:
            chunk = _Chunk(max(self.chunk_bytes, 1 << max(0, nbytes - 1).bit_length()), self.pin)
            self._chunks.append(chunk)
            self.reserved_bytes += chunk.tensor.numel()
            offset = chunk.take(nbytes)
        view = chunk.tensor[offset:offset + size].view(dtype).view(shape)
        self._taken[view.data_ptr()] = (chunk, offset, nbytes)
        return view

    def free(self, view: torch.Tensor) -> None:
        """Give back a tensor `empty` returned (no-op when unpooled); it must no longer be used,
        including by a copy still in flight."""
        taken = self._taken.pop(view.data_ptr(), None)
        if taken is not None:
            chunk, offset, nbytes = taken
            chunk.give(offset, nbytes)

    @property
    def free_bytes(self) -> int:
        """Pinned bytes held by the pool and not handed out."""
        return sum(b - a for chunk in self._chunks for a, b in chunk.free)

    def close(self) -> None:
        self._chunks.clear()
        self._taken.clear()
        self.reserved_bytes = 0
