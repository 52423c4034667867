"""`StepClock`: each step as the device and the compute thread saw it, from CUDA events and host clocks.

A step profile (`engine.runtime.step_profile`) synchronizes at every seam, so it shows where time goes but not what
the overlapped step does. The clock synchronizes nothing: it records a CUDA event on a side stream before and after
each transfer (`Transfers`), on the compute stream around each compute action (the executor's loop), and times the
compute thread while it blocks in `Pending.wait`. The executor closes a step after its last head picked its tokens:
that pick has just synchronized the compute stream, not the device, so the step's transfers may still be in flight
(the next step's loads issued ahead); the step is folded into `steps` once its events have completed (at a later
step's close, or `take`). The executor never synchronizes the device at a step end for the clock: that would
hold the next step's loads until the step is over, and a clocked run (every benchmark record) would not run the
schedule an unclocked one runs.

Per step (`steps`, one dict each, seconds):
    h2d_busy_s    union of the host->device streams' transfer spans (weights, dense weights, loads); a span
                  runs from the transfer's issue point on its stream (its waits for buffer releases included)
                  to its last copy's end
    d2h_busy_s    the same for the store stream (device->host)
    compute_s     sum of the compute actions' spans on the compute stream (their waits for loads included)
    ahead_s       the same for the ahead prefill's layers riding on the step (`engine.runtime.ahead`)
    other_s       the same for every other action (the work they put on the compute stream: a store's
                  quantization, a hidden state's copy)
    host_gap_s    compute-stream time between one span's end and the next one's start: the device idle
                  because the compute thread had not yet issued the next action
    span_s        first recorded event to last
    host_s        the compute thread's own time inside the actions, per verb ("ahead" for the ahead layers):
                  issuing their work, or blocked where an operation synchronizes
    lead_s        how far the device ran behind the compute thread: per compute-stream action, the time from
                  its issue on the host to its start on the device (`min`, `median`); near zero, the device
                  waits for the host (the step is bound by the host), large, the host runs ahead
    gc_s          time in Python's garbage collector during the step (any thread)
    host_wait_s   the compute thread blocked in `Pending.wait`, per channel (a store's wait is the host-side
                  write into its home on the store thread)
    allocator     what torch's caching allocator did in the step (`torch.cuda.memory_stats` deltas):
                  `retries` (an allocation past the cap freed cached blocks, synchronizing the device, and
                  tried again), `device_allocs`/`device_frees` (memory taken from or given back to the driver)
CUDA only: on a CPU the executor attaches no clock.
"""
from __future__ import annotations

import gc
import statistics
import time
from collections import defaultdict
from typing import NamedTuple

import torch

H2D = ("weight", "weight_dense", "load")
_ALLOCATOR = {"retries": "num_alloc_retries", "device_allocs": "num_device_alloc", "device_frees": "num_device_free"}


_GC = {"s": 0.0, "t0": 0.0}                     # seconds in Python's collector, this process (`_gc_hook`)


def _gc_hook(phase: str, info: dict) -> None:
    if phase == "start":
        _GC["t0"] = time.perf_counter()
    else:
        _GC["s"] += time.perf_counter() - _GC["t0"]


def _allocator_counts() -> dict[str, int]:
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return {name: int(stats.get(key, 0)) for name, key in _ALLOCATOR.items()}


def _union(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of [a, b) spans (ms in, ms out)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class _Closed(NamedTuple):
    """One closed step, waiting for its events to complete: its transfers and computes, the compute thread's
    seconds per verb and waits per channel, its gc seconds and allocator deltas, and the event recorded at its
    close on the compute stream with the host's clock then."""

    transfers: list[tuple[str, torch.cuda.Event, torch.cuda.Event]]
    computes: list[tuple[str, torch.cuda.Event, torch.cuda.Event, float]]
    host: dict[str, float]
    waits: dict[str, float]
    gc_s: float
    allocator: dict[str, int]
    final: torch.cuda.Event
    host_final: float

    def complete(self) -> bool:
        return self.final.query() and all(end.query() for _, _, end in self.transfers)

    def wait(self) -> None:
        """Block the host until every event of the step has completed (each on its own device and stream)."""
        self.final.synchronize()
        for _, _, end in self.transfers:
            end.synchronize()


class StepClock:
    """Collects one step's events (`transfer_start/transfer_end`, `compute_start/compute_end`, `host_wait`);
    `close_step()` (right after the step's last token pick) closes them into one entry of `steps`, once they
    have completed; `take()` waits for them."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self._closed: list[_Closed] = []
        self._transfers: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._computes: list[tuple[str, torch.cuda.Event, torch.cuda.Event, float]] = []   # kind, events, issued
        self._open: tuple[str, str, torch.cuda.Event, float] | None = None
        self._host: dict[str, float] = defaultdict(float)
        self._waits: dict[str, float] = defaultdict(float)
        self._counts = _allocator_counts()
        if _gc_hook not in gc.callbacks:
            gc.callbacks.append(_gc_hook)
        self._gc = _GC["s"]

    @staticmethod
    def _event(stream: "torch.cuda.Stream | None" = None) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def transfer_start(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """Before a transfer's first operation on `stream`; give the result to `transfer_end`."""
        return self._event(stream)

    def transfer_end(self, channel: str, start: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        """After the transfer's last copy was issued on `stream` (same stream as its start)."""
        self._transfers.append((channel, start, self._event(stream)))

    def compute_start(self, kind: str = "compute", label: str | None = None) -> None:
        """Before an action (on the current stream); `kind` "compute", "ahead" or "other"; `label` (default
        `kind`) names it in `host_s`."""
        self._open = (kind, label or kind, self._event(), time.perf_counter())

    def compute_end(self) -> None:
        """After the action `compute_start` opened."""
        if self._open is not None:
            kind, label, start, t0 = self._open
            self._computes.append((kind, start, self._event(), t0))
            self._host[label] += time.perf_counter() - t0
            self._open = None

    def host_wait(self, channel: str, seconds: float) -> None:
        """The compute thread blocked `seconds` waiting for a `channel` transfer."""
        self._waits[channel] += seconds

    def close_step(self) -> None:
        """End the step: its events wait (`_Closed`) until they have completed, then fold into `steps`."""
        counts, before = _allocator_counts(), self._counts
        gc_s, self._gc = _GC["s"] - self._gc, _GC["s"]
        self._counts = counts
        if self._transfers or self._computes:
            # the compute stream has just been synchronized by the token pick: `final` runs at once
            final, host_final = self._event(), time.perf_counter()
            self._closed.append(_Closed(self._transfers, self._computes, dict(self._host), dict(self._waits), gc_s,
                                        {name: counts[name] - before[name] for name in _ALLOCATOR}, final,
                                        host_final))
            self._transfers, self._computes = [], []
        self._host.clear()
        self._waits.clear()
        self._fold(wait=False)

    def _fold(self, wait: bool) -> None:
        """Turn the closed steps whose events have completed (with `wait`, every one) into `steps`, in order."""
        while self._closed and (wait or self._closed[0].complete()):
            step = self._closed.pop(0)
            if wait:
                step.wait()
            self.steps.append(_summary(step))

    def take(self) -> list[dict]:
        """The steps closed so far (waiting for their events), emptied."""
        self._fold(wait=True)
        out, self.steps = self.steps, []
        return out


def _summary(step: _Closed) -> dict:
    """One closed step's entry of `StepClock.steps` (module docstring), its events completed."""
    transfers = step.transfers
    ref = step.computes[0][1] if step.computes else transfers[0][1]

    def at(e: torch.cuda.Event) -> float:
        return ref.elapsed_time(e)                      # ms, negative when before ref
    h2d = [(at(a), at(b)) for c, a, b in transfers if c in H2D]
    d2h = [(at(a), at(b)) for c, a, b in transfers if c not in H2D]
    comp = [(kind, at(a), at(b)) for kind, a, b, _ in step.computes]
    gap = sum(max(0.0, s1 - e0) for (_, _, e0), (_, s1, _) in zip(comp, comp[1:]))
    end_ms = at(step.final)
    lead = [max(0.0, step.host_final - (end_ms - at(a)) / 1e3 - t0) for _, a, _, t0 in step.computes]
    marks = [t for span in h2d + d2h for t in span] + [t for _, a, b in comp for t in (a, b)]

    def busy(kind: str) -> float:
        return round(sum(b - a for k, a, b in comp if k == kind) / 1e3, 6)
    return {
        "h2d_busy_s": round(_union(h2d) / 1e3, 6), "d2h_busy_s": round(_union(d2h) / 1e3, 6),
        "compute_s": busy("compute"), "ahead_s": busy("ahead"), "other_s": busy("other"),
        "host_gap_s": round(gap / 1e3, 6),
        "span_s": round((max(marks) - min(marks)) / 1e3, 6),
        "host_wait_s": {c: round(s, 6) for c, s in sorted(step.waits.items())},
        "host_s": {label: round(s, 6) for label, s in sorted(step.host.items())},
        "lead_s": {"min": round(min(lead), 6), "median": round(statistics.median(lead), 6)} if lead else {},
        "gc_s": round(step.gc_s, 6),
        "allocator": step.allocator,
    }
