"""Who last used the KV cache's shared buffers, so the next user waits for that one only.

`StagingClaims`: the pinned staging buffers a cache store writes through (one per key); a new store into a
buffer waits for the previous store that used it. `BufferReleases`: the device buffers a cache load fills
(`kvbuf{slot}.s{n}`); a load waits for the event recorded after the decode compute that last read the same
allocation. Both serve `engine.runtime.kv_cache.KVHome`.
"""
from __future__ import annotations

import torch

from engine.quant.qtensor import QTensor
from engine.runtime.transfers import Pending
from engine.storage.tiers import Stored


class StagingClaims:
    """Which store last used each (shared, slot-keyed) staging buffer: a new store waits for it first."""

    def __init__(self) -> None:
        self._last: dict[str, Pending] = {}

    def claim(self, key: str) -> None:
        pending = self._last.pop(key, None)
        if pending is not None:
            pending.wait()

    def record(self, key: str, pending: Pending) -> None:
        self._last[key] = pending


class BufferReleases:
    """When each shared device cache buffer (`kvbuf{slot}.s{n}`) was last read: the event recorded after the
    decode compute that read it, and the buffer's address. A load into the same allocation waits for that
    event only, not for every compute issued before it (an ahead prefill's chunk, `engine.runtime.ahead`,
    runs between a decode attention and the next cache load, and must not hold the link back)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[torch.cuda.Event, int]] = {}

    def record(self, key: str, ptr: int) -> None:
        event = torch.cuda.Event()
        event.record()
        self._last[key] = (event, ptr)

    def after(self, key: str, ptr: int) -> list[torch.cuda.Event] | None:
        """The events a load into `key` at `ptr` waits for (None: everything issued, as for a new buffer)."""
        held = self._last.get(key)
        return [held[0]] if held is not None and held[1] == ptr else None


def address(x: Stored) -> int:
    """The device address of a buffer (a 4-bit one's packed data)."""
    return (x.data if isinstance(x, QTensor) else x).data_ptr()
