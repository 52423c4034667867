"""Homes of the prefill's hidden states between layers, per GPU batch, split along the hidden dim by the policy's
act fractions. With all activations on the gpu tier (the usual case) every method is a no-op.

Only a hidden state of more than one position is parked. A decode step's [b, 1, h] (a few MiB) stays on the
device: parking it buys no memory worth having and puts a device->host->device round trip on every (layer,
GPU batch) of the step's critical path, queued behind the cache loads on the load stream (H200, Mixtral-8x7B,
1024x2, cache on the host, 16 GiB: 0.934 s per decode step with the hidden states parked, 0.735 s with them on
the device).

`store` moves the non-gpu part of a batch's hidden [b, s, h] to its cpu/disk home and keeps only the gpu
part on the device; `load` starts bringing it back; `ready` reassembles [b, s, h] on the device once
the loads completed. A CPU-only machine treats the cpu tier as device memory (nothing moves).

A hidden parked whole in host memory comes back by rows when the load is given the prefill's row chunks: one
copy per chunk, each with its own event, and `arriving` hands the compute the buffer with `upto(r)`, which
makes the compute stream wait only for the copies of rows [0, r). With two GPU batches a hidden's load is
issued just before its own compute (`engine.runtime.schedule`) and its copies queue behind the previous
batch's compute (a fresh device buffer may reuse memory that compute still reads), so loaded whole, every
batch switch of the prefill waits for the whole hidden to cross the link: Mixtral-8x7B at prompt 512,
256x2, H200, ~21 ms at each of the 8 batch switches of a 4-layer cut (`benchmarks/profiling/timeline.py`'s largest
compute-stream gaps, ~9% of its prefill; 64 switches in the whole model). By rows,
the first chunk's rows (a few MiB) are the wait; the rest arrive while the first chunks compute.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from engine.policy.placement import split_ranges
from engine.runtime.arena import Arena
from engine.runtime.transfers import Transfers
from engine.storage.copy import copy
from engine.storage.tiers import Tier


class _Parked:
    """A hidden state whose parts live on several tiers: (tier, start, end, tensor, pending)."""

    def __init__(self, shape: torch.Size, parts: list):
        self.shape, self.parts = shape, parts


class _ByRows:
    """A hidden coming back by rows: the device buffer [b, s, h] and each copy's (end row, pending)."""

    def __init__(self, buffer: torch.Tensor, arrivals: list):
        self.buffer, self.arrivals = buffer, arrivals
        self._waited, self._rows = 0, 0      # copies waited for, and the rows [0, _rows) they brought

    def upto(self, rows: int | None = None) -> None:
        """Make the compute stream wait for the copies of rows [0, rows) (all rows: None)."""
        while self._waited < len(self.arrivals) and (rows is None or self._rows < rows):
            self._rows, pending = self.arrivals[self._waited]
            pending.wait()
            self._waited += 1


def arrived(rows: int | None = None) -> None:
    """The `upto` of a hidden already on the device: nothing to wait for."""


class ActHomes:
    def __init__(self, arena: Arena, act_gpu: float, act_cpu: float, num_batches: int):
        self.arena, self.act_gpu, self.act_cpu = arena, act_gpu, act_cpu
        self.device = arena.device
        self.active = act_gpu < 1.0 and not (self.device.type == "cpu" and act_gpu + act_cpu >= 1.0)

    def store(self, k: int, x, transfers: Transfers):
        """x [b, s, h] on the device -> a parked hidden (or x itself when nothing moves: s == 1 included)."""
        if not self.active or not isinstance(x, torch.Tensor) or x.shape[-2] <= 1:
            return x
        parts = []
        for n, (placed, a, b) in enumerate(split_ranges(x.shape[-1], self.act_gpu, self.act_cpu)):
            tier, piece = Tier(placed), x[..., a:b]
            if tier is Tier.GPU or (tier is Tier.CPU and self.device.type == "cpu"):
                parts.append((Tier.GPU, a, b, piece.contiguous(), None))
                continue
            home = self.arena.get(f"act.{k}.{n}", tier, tuple(piece.shape), x.dtype)

            def fn(stream, home=home, piece=piece):
                if stream is not None:
                    piece.record_stream(stream)
                return copy(home, piece, stream=stream)
            # a cpu home is ordered on the device (the load's stream waits for this copy's event); a disk
            # home is written by the host, so its copy must be complete there first
            parts.append((tier, a, b, home, transfers.submit("store", fn, host_wait=tier is Tier.DISK)))
        return _Parked(x.shape, parts)

    def load(self, k: int, parked, transfers: Transfers, rows: Sequence[tuple[int, int]] = ()):
        """Start copying a parked hidden's cpu/disk parts back to the device; a hidden parked whole in host
        memory (an accelerator's: a CPU device parks nothing there) comes back by `rows` (the prefill's row
        chunks [r0, r1), ascending) when there are several (module docstring)."""
        if not isinstance(parked, _Parked):
            return parked
        if len(rows) > 1 and len(parked.parts) == 1 and parked.parts[0][0] is Tier.CPU:
            return self._load_rows(parked, transfers, rows)
        parts = []
        for tier, a, b, t, pending in parked.parts:
            if tier is Tier.GPU:
                parts.append((tier, a, b, t, None))
                continue
            if pending is not None:
                pending.wait()
            dev = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            parts.append((Tier.GPU, a, b, dev, transfers.submit("load", lambda s, d=dev, t=t: copy(d, t, stream=s),
                                                                    threaded=tier is Tier.DISK)))
        return _Parked(parked.shape, parts)

    def _load_rows(self, parked: _Parked, transfers: Transfers, rows: Sequence[tuple[int, int]]) -> _ByRows:
        _, _, _, home, pending = parked.parts[0]
        if pending is not None:
            pending.wait()
        dev = torch.empty(home.shape, dtype=home.dtype, device=self.device)                     # [b, s, h]
        arrivals = [(r1, transfers.submit("load", lambda s, d=dev[r0:r1], t=home[r0:r1]: copy(d, t, stream=s)))
                    for r0, r1 in rows]
        return _ByRows(dev, arrivals)

    def arriving(self, k: int, parked) -> tuple[torch.Tensor, Callable[[int | None], None]]:
        """The hidden [b, s, h] on the device and `upto(rows)`, which the compute calls before it reads rows
        [0, rows) (None: all of them). Only a hidden loaded by rows has copies still to wait for; any other
        is `ready`'s, complete."""
        if isinstance(parked, _ByRows):
            return parked.buffer, parked.upto
        return self.ready(k, parked), arrived

    def ready(self, k: int, parked):
        """The hidden [b, s, h] on the device (waits for pending loads)."""
        if isinstance(parked, _ByRows):
            parked.upto()
            return parked.buffer
        if not isinstance(parked, _Parked):
            return parked
        pieces = []
        for tier, a, b, t, pending in parked.parts:
            if pending is not None:
                pending.wait()
            pieces.append(t if tier is Tier.GPU else t.to(self.device))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)             # [b, s, h]
