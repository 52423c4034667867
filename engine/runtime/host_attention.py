"""Host attention off the compute thread: the CGOPipe half that runs next to a host-resident KV cache.

`HostAttention` owns one worker thread. `start` moves a GPU batch's new q/k/v to the host (CUDA: into pinned
staging buffers on the "store" stream; a CPU device's tensors are host tensors already) and queues `work`
(write the new k/v into the home, attend over it: `KVHome`'s host path) on the thread; the compute thread
returns at once and goes on launching device work for other GPU batches. `HostJob.join` waits for the
thread's result and brings it to the device (CUDA: from a pinned buffer on the "load" stream, which the
compute stream then waits for; the host never waits for the device here). Jobs run in issue order, one at a
time; each uses torch's intra-op threads across rows and heads (torch releases the GIL in its kernels).
Without `overlap` a job runs inline in `start`.

Staging buffers are arena buffers `{key}.q/.k/.v/.out` (cpu tier, pinned), one set per key: a key (GPU batch
and cache segment) has at most one job in flight, since its previous one is joined before the next starts.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from engine.runtime.arena import Arena
from engine.runtime.transfers import Transfers
from engine.storage.copy import copy
from engine.storage.tiers import Tier

HostWork = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]   # (q, k, v) host -> out host


class HostJob:
    """One queued host attention; `join()` -> its output on the compute device (once)."""

    def __init__(self, result: Future | torch.Tensor, device: torch.device, transfers: Transfers):
        self._result, self._device, self._transfers = result, device, transfers

    def join(self) -> torch.Tensor:
        out = self._result.result() if isinstance(self._result, Future) else self._result
        if self._device.type != "cuda":
            return out
        dev = torch.empty(out.shape, dtype=out.dtype, device=self._device)
        self._transfers.submit("load", lambda stream: copy(dev, out, stream=stream)).wait()
        return dev


class HostAttention:
    """The host attention thread of one executor; `drain()` waits for every job, `close()` joins the thread."""

    def __init__(self, arena: Arena, transfers: Transfers):
        self.arena, self.transfers = arena, transfers
        self.device = arena.device
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: list[Future] = []

    def start(self, key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, work: HostWork) -> HostJob:
        """Queue `work(q, k, v)` on the host thread, q [b, nq, 1, hd] and k/v [b, nkv, 1, hd] on the device."""
        event = None
        if self.device.type == "cuda":
            staged = []
            with torch.cuda.device(self.device):                # the streams of the executor's device
                for name, x in (("q", q), ("k", k), ("v", v)):
                    buf = self.arena.get(f"{key}.{name}", Tier.CPU, tuple(x.shape), x.dtype)
                    event = copy(buf, x, stream=self.transfers.streams.get("store"))
                    staged.append(buf)
            q, k, v = staged
            out_buf = self.arena.get(f"{key}.out", Tier.CPU, tuple(q.shape), q.dtype)

        def run() -> torch.Tensor:
            with torch.inference_mode():
                if event is not None:
                    event.synchronize()
                out = work(q, k, v)                                                 # [b, nq, 1, hd]
                if self.device.type != "cuda":
                    return out
                out_buf.copy_(out)
                return out_buf

        if not self.transfers.overlap:
            return HostJob(run(), self.device, self.transfers)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine-host-attn")
        future = self._pool.submit(run)
        self._jobs = [f for f in self._jobs if not f.done()] + [future]
        return HostJob(future, self.device, self.transfers)

    def drain(self) -> None:
        """Wait for every queued job (errors are the joiner's to see; here they only end the wait)."""
        for future in self._jobs:
            future.exception()
        self._jobs = []

    def close(self) -> None:
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pool = None
