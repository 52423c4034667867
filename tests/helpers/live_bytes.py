"""Bytes that CPU tensors allocate while a block runs, tracked through torch's dispatch (live and at peak)."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every storage an op allocates while active, live (freed when the storage dies)
    and at peak; `exclude(ptrs)` afterwards drops the buffers the budget counts elsewhere (arena homes)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []          # (+/- bytes, data_ptr) in order
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                ptr, n = st.data_ptr(), st.nbytes()
                if n and ptr not in self._seen:
                    self._seen.add(ptr)
                    self.events.append((n, ptr))
                    weakref.finalize(st, self._freed, ptr, n)
        return out

    def _freed(self, ptr: int, n: int) -> None:
        self._seen.discard(ptr)
        self.events.append((-n, ptr))

    def peak(self, exclude: set[int] = frozenset()) -> int:
        live = best = 0
        for n, ptr in self.events:
            if ptr not in exclude:
                live += n
                best = max(best, live)
        return best
