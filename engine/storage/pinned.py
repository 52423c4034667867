"""Host buffers for the cpu tier: pinned when a GPU exists, carved out of large pooled allocations.

torch's pinned allocator rounds each allocation up to a power of two (a 5 GiB tensor costs 8 GiB), so the
pool pins power-of-two chunks (1 GiB, or the next power of two for a bigger request) and hands out aligned
sub-views, first fit over all chunks. Without CUDA, buffers are plain tensors. Buffers are never returned
individually; the pool is freed as a whole by `close`.
"""
from __future__ import annotations

import torch

_ALIGN = 512
_CHUNK = 1 << 30


class HostPool:
    def __init__(self, pin: bool, chunk_bytes: int = _CHUNK):
        self.pin = pin
        self.chunk_bytes = chunk_bytes
        self._chunks: list[list] = []            # [tensor, next free offset]
        self.reserved_bytes = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor of `shape` and `dtype` (pinned when the pool pins)."""
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not self.pin:
            return torch.empty(shape, dtype=dtype)
        chunk = next((c for c in self._chunks if c[1] + nbytes <= c[0].numel()), None)
        if chunk is None:
            size = max(self.chunk_bytes, 1 << max(0, nbytes - 1).bit_length())
            chunk = [torch.empty(size, dtype=torch.uint8, pin_memory=True), 0]
            self._chunks.append(chunk)
            self.reserved_bytes += size
        view = chunk[0][chunk[1]:chunk[1] + nbytes].view(dtype).view(shape)
        chunk[1] += -(-nbytes // _ALIGN) * _ALIGN
        return view

    def close(self) -> None:
        self._chunks.clear()
        self.reserved_bytes = 0
