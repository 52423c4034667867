"""`StepProfile`: where a block's prefill and decode steps go, per layer, recorded through the executor's loop.

A hook on the one loop, never a copy of it: the executor calls `begin(action)` before and `end()` after each
schedule action when a profile is attached (`Executor.profiler`; None costs one check per action), and
`lap(part)` at the seams inside a compute. Each interval is charged to (phase, layer j, part), phase
"prefill" (step 0) or "decode" (every later step, summed), by the step running when it happens (a step
runs from its first compute to the next step's: the next layer's loads issued in a slot count there). Parts:
    load_weight, load_cache, load_hidden, store_cache, store_hidden   issuing (and, synchronized, doing) a transfer
    weight_wait     a compute waiting for its layer's weight copies (H2D / disk)
    dequant         building the layer's dense weights (4-bit dequantization, buffer views)
    cache_wait      a compute waiting for its cache/hidden loads
    compute         the layer's maths (for attention layers this includes CPU attention and the KV writes)
    sync            the slot's closing wait for every transfer it issued (host waits)
    other           the step's time outside every action (the schedule iterator, Python between actions)
With `synchronize` (default on CUDA) the device is synchronized at every seam, so device time lands on the
part that launched it and the parts sum to the step's wall time; that serializes the overlap, so a profiled
run measures where the time goes, not the overlapped step time (run unprofiled for that).
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from engine.runtime.schedule import Action

PARTS = ("load_weight", "load_cache", "load_hidden", "store_cache", "store_hidden", "weight_wait", "dequant",
         "cache_wait", "compute", "sync", "join_attention", "prefetch_weight", "prefetch_cache")


class StepProfile:
    """Accumulates seconds per (phase, j, part) over the blocks it is attached for; `report()` gives them."""

    def __init__(self, device: torch.device, layer_kinds: list[str], synchronize: bool | None = None) -> None:
        self.device = torch.device(device)
        self.kinds = list(layer_kinds)
        self.synchronize = self.device.type == "cuda" if synchronize is None else synchronize
        self.seconds: dict[tuple[str, int, str], float] = defaultdict(float)
        self.step_s: dict[str, float] = defaultdict(float)
        self.steps: dict[str, int] = defaultdict(int)
        self._action: Action | None = None
        self._t = 0.0
        self._step_t0: float | None = None
        self._step_i: int | None = None

    def _now(self) -> float:
        if self.synchronize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @staticmethod
    def _phase(i: int) -> str:
        return "prefill" if i == 0 else "decode"

    def begin(self, action: Action) -> None:
        """Before an action: a new step starts the step clock."""
        now = self._now()
        if self._step_i != action.i and action.verb == "compute":
            self._close_step(now)
            self._step_i, self._step_t0 = action.i, now
        self._action, self._t = action, now

    def lap(self, part: str) -> None:
        """Charge the time since the last seam to `part` of the running action's layer."""
        now = self._now()
        a = self._action
        if a is not None:
            step = self._step_i if self._step_i is not None else a.i
            self.seconds[(self._phase(step), a.j, part)] += now - self._t
        self._t = now

    def end(self) -> None:
        """After an action: the rest of its time goes to its own verb (a compute's last part is `compute`)."""
        if self._action is not None:
            self.lap(self._action.verb)
        self._action = None

    def _close_step(self, now: float) -> None:
        if self._step_i is not None and self._step_t0 is not None:
            phase = self._phase(self._step_i)
            self.step_s[phase] += now - self._step_t0
            self.steps[phase] += 1
        self._step_i = self._step_t0 = None

    def finish(self) -> None:
        """At the block's end: close the running step."""
        self._close_step(self._now())

    def report(self) -> dict:
        """{phase: {"steps", "step_s" (wall, summed over steps), "parts_s" (sum per part), "other_s" (wall not
        inside an action), "layers": [{"j", "kind", <part>_s...}]}} for "prefill" and "decode"."""
        out = {}
        for phase in ("prefill", "decode"):
            layers, parts = [], dict.fromkeys(PARTS, 0.0)
            for j, kind in enumerate(self.kinds):
                row = {"j": j, "kind": kind}
                for part in PARTS:
                    s = self.seconds.get((phase, j, part), 0.0)
                    row[f"{part}_s"] = s
                    parts[part] += s
                layers.append(row)
            inside = sum(parts.values())
            out[phase] = {"steps": self.steps.get(phase, 0), "step_s": self.step_s.get(phase, 0.0),
                          "parts_s": parts, "other_s": max(0.0, self.step_s.get(phase, 0.0) - inside),
                          "layers": layers}
        return out
