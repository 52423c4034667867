"""Asynchronous transfer channels of the executor: CUDA streams and a disk-I/O thread pool.

A transfer is a function `fn(stream)` that issues copies (usually through `engine.storage.copy`) and
returns the CUDA event recorded after them, or None when it ran entirely on the host. `submit` runs it:
inline, or on the thread pool when it touches the disk; `Pending.wait()` makes its result usable on the
compute stream (and, with `host_wait`, on the host), then runs its `then` callback in the calling thread.
`submit_host` is for device->host copies whose data the host then works on: the copies are issued now and
a worker thread waits for them and runs `then`, so the compute thread never blocks on them; `wait()` joins.
With `overlap=False` every transfer is waited for as soon as it is submitted (no concurrency at all).
`clock` (a `StepClock`, optional, CUDA only) is told of every transfer's span on its stream and of every
blocking wait.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from engine.runtime.step_clock import StepClock

TransferFn = Callable[["torch.cuda.Stream | None"], "torch.cuda.Event | None"]
CHANNELS = ("weight", "weight_dense", "load", "store")


class Pending:
    def __init__(self, future: Future | None, event, host_wait: bool, then: Callable[[], None] | None,
                 clock: StepClock | None = None, channel: str = ""):
        self._future = future
        self._event = event
        self._host_wait = host_wait
        self._then = then
        self._clock, self._channel = clock, channel
        self.done = False

    def wait(self) -> None:
        """Block until the transfer is usable by the compute stream (and the host, with host_wait)."""
        if self.done:
            return
        t0 = time.perf_counter()
        event = self._future.result() if self._future is not None else self._event
        if event is not None:
            if self._host_wait:
                event.synchronize()
            else:
                torch.cuda.current_stream().wait_event(event)
        if self._clock is not None:
            self._clock.host_wait(self._channel, time.perf_counter() - t0)
        if self._then is not None:
            self._then()
        self.done = True


    def complete(self) -> None:
        """Block the host until the transfer's copies are done (before their source is rewritten); its compute
        stream wait and `then` are left to `wait`."""
        event = self._future.result() if self._future is not None else self._event
        if event is not None:
            event.synchronize()


class Transfers:
    """Owns the side streams (CUDA only) and the I/O threads; `close` joins the threads."""

    def __init__(self, device: torch.device, overlap: bool, io_threads: int = 2):
        self.device = device
        self.overlap = overlap
        self.cuda = device.type == "cuda"
        self.streams = {c: torch.cuda.Stream(device) for c in CHANNELS} if self.cuda else {}
        self._pool: ThreadPoolExecutor | None = None
        self._finisher: ThreadPoolExecutor | None = None
        self._io_threads = io_threads
        self.clock: StepClock | None = None

    def submit(self, channel: str, fn: TransferFn, *, threaded: bool = False, host_wait: bool = False,
               then: Callable[[], None] | None = None) -> Pending:
        """Run `fn` on `channel`'s stream (in a worker thread if `threaded` and overlapping)."""
        stream = self.streams.get(channel)
        if threaded and self.overlap:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._io_threads, thread_name_prefix="engine-io")
            pending = Pending(self._pool.submit(self._run, fn, stream, channel), None, host_wait, then,
                              self.clock, channel)
        else:
            pending = Pending(None, self._run(fn, stream, channel), host_wait, then, self.clock, channel)
        if not self.overlap:
            pending.wait()
        return pending

    def submit_host(self, channel: str, fn: TransferFn, then: Callable[[], None]) -> Pending:
        """Issue `fn`'s copies now on `channel`'s stream; a worker thread waits for their event and runs `then`
        (host work on the copied data). Without CUDA or overlap, everything completes before returning."""
        event = self._run(fn, self.streams.get(channel), channel)
        if not (self.cuda and self.overlap):
            if event is not None:
                event.synchronize()
            then()
            pending = Pending(None, None, False, None)
            pending.done = True
            return pending

        def finish() -> None:
            if event is not None:
                event.synchronize()
            with torch.inference_mode():
                then()
        if self._finisher is None:                      # one thread: host work runs in issue order
            self._finisher = ThreadPoolExecutor(1, thread_name_prefix="engine-store")
        return Pending(self._finisher.submit(finish), None, False, None, self.clock, channel)

    def _run(self, fn: TransferFn, stream, channel: str):
        with torch.inference_mode():
            if stream is None:
                return fn(None)
            with torch.cuda.device(self.device):
                clock = self.clock
                if clock is None:
                    return fn(stream)
                start = clock.transfer_start(stream)
                event = fn(stream)
                clock.transfer_end(channel, start, stream)
                return event

    def close(self) -> None:
        for pool in (self._pool, self._finisher):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._finisher = None
