"""The micro-batch schedule of a pipeline of stages (FlexGen section 4.4), torch-free.

Indices: s stage (0 = the one with the embedding), i generation step (0 = prefill), m micro-batch (one
block of the policy: its own GPU batches, caches and decoder). A task (s, i, m) runs stage s's layers for
step i of micro-batch m. Every stage works through the same order, step-major: (0, 0), (0, 1), ...,
(0, M-1), (1, 0), ... so while stage s runs micro-batch m, stage s+1 runs m-1 and stage 0 can already start
the next step of a micro-batch whose tokens came back from the last stage. With M >= S micro-batches every
stage is busy in the steady state (`simulate` shows it); with M = 1 the stages take turns.

Dependencies (`source`): (s, i, m) waits for (s-1, i, m) (its hidden states); (0, i, m) for i > 0 waits for
(S-1, i-1, m) (the tokens its embedding feeds); (0, 0, m) waits for nothing. Messages between neighbouring
stages are therefore FIFO in this order, and a stage only ever waits on its one inbox.
"""
from __future__ import annotations

from typing import NamedTuple


class Task(NamedTuple):
    s: int
    i: int
    m: int


def stage_order(num_steps: int, num_micro: int) -> list[tuple[int, int]]:
    """The (i, m) a stage runs, in order (the same for every stage)."""
    return [(i, m) for i in range(num_steps) for m in range(num_micro)]


def source(task: Task, num_stages: int) -> Task | None:
    """The task whose output `task` waits for (None: it can start at once)."""
    s, i, m = task
    if s > 0:
        return Task(s - 1, i, m)
    if i > 0:
        return Task(num_stages - 1, i - 1, m)
    return None


def simulate(num_stages: int, num_steps: int, num_micro: int,
             durations: list[float] | None = None) -> dict[Task, tuple[float, float]]:
    """(start, end) of every task when stage s's tasks each take `durations[s]` (default 1) and a stage runs
    its tasks one at a time in `stage_order`, each as soon as its source has ended."""
    durations = durations or [1.0] * num_stages
    if len(durations) != num_stages:
        raise ValueError(f"simulate: {len(durations)} durations for {num_stages} stages")
    times: dict[Task, tuple[float, float]] = {}
    free = [0.0] * num_stages
    order = stage_order(num_steps, num_micro)
    for i, m in order:                   # step-major across stages too: every source is simulated first
        for s in range(num_stages):
            task = Task(s, i, m)
            src = source(task, num_stages)
            start = max(free[s], times[src][1] if src is not None else 0.0)
            times[task] = (start, start + durations[s])
            free[s] = start + durations[s]
    return times


def utilization(num_stages: int, num_steps: int, num_micro: int) -> float:
    """Busy share of the stages over the pipeline's makespan, with unit task times (1.0 = never idle)."""
    times = simulate(num_stages, num_steps, num_micro)
    makespan = max(end for _, end in times.values())
    return len(times) / (num_stages * makespan)
