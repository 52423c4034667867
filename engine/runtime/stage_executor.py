"""`StageExecutor`: the one executor restricted to a pipeline stage's layers and driven one step at a time.

A stage owns its device, budget, weight homes (only its own layers), arena and streams, as any `Executor`.
It holds M micro-batches at once (each a `BlockState` with its own caches, named `kv.m{m}.{j}.{k}`); the
pipeline (`engine.runtime.pipeline`) calls `step(i, m, ...)` in `pipeline_schedule.stage_order`. A step runs
the block schedule of one step over the stage's layers (the same actions, verbs and overlap as a whole
block), so offloading inside a stage is exactly the single-device executor's. Between stages travel a micro-batch's
hidden states (`Hidden` per GPU batch) and the last stage's `StepResult`s of the step before, which the
other stages replay (`_apply_step`) so their batches end, advance and compact their rows as the last one did.

A stage runs decode attention's host part in line (no MoE CGOPipe join inside a stage).
Not overlapped across micro-batches: each step starts by loading its first layer (the block schedule
prefetches within a step only), one layer's load per (step, micro-batch) of a stage's L_s layers.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import ContextManager, Iterator

import torch

from engine.models.layers import reserve_positions
from engine.policy.partition import Stage
from engine.policy.policy import Policy
from engine.runtime.block_state import BlockState, Hidden, StepResult
from engine.runtime.executor import Executor
from engine.runtime.schedule import Action, block_schedule
from engine.runtime.selector import TokenSelector
from engine.storage.tiers import Tier

MicroBlock = tuple[list[list[int]], list[int], TokenSelector]   # prompts, max_new_tokens, selector


def step_actions(i: int, num_layers: int, num_batches: int, *, paged: bool) -> Iterator[Action]:
    """The block schedule of one step at step index i (its loads, computes, stores and syncs; step 0, the
    prefill, in its snake order)."""
    return block_schedule(i + 1, num_layers, num_batches, paged=paged, first=i)


def on_device(device: torch.device) -> ContextManager:
    """`device` as the current CUDA device of this thread (code that uses the current device or stream,
    such as a transfer's wait, then means this one); a no-op for a CPU device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def close_on_devices(executors: list[Executor]) -> None:
    """Close each executor with its device current."""
    for ex in executors:
        with on_device(ex.device):
            ex.close()


def to_device(h: Hidden, device: torch.device) -> Hidden:
    """A hidden state (a tensor, a (prefix, rows) pair or None) on `device` (device-to-device copies are
    ordered on both devices' current streams by torch)."""
    if h is None:
        return None
    if isinstance(h, tuple):
        return tuple(x.to(device, non_blocking=True) for x in h)   # type: ignore[return-value]
    return h.to(device, non_blocking=True)


class StageExecutor(Executor):
    """Stage `stage.index` of a pipeline on `device`. Not thread-safe: one thread drives it."""

    def __init__(self, loaded, policy: Policy, stage: Stage, *, device: torch.device, dtype: torch.dtype,
                 gpu_memory: int | None = None, cpu_memory: int | None = None, disk_dir: Path | None = None):
        self.stage = stage
        self.micro: list[BlockState] = []
        self._work = 0
        super().__init__(loaded, policy, device=device, dtype=dtype, gpu_memory=gpu_memory, cpu_memory=cpu_memory,
                         disk_dir=disk_dir, stage=stage)
        self.pipelined = False      # a step runs the plain block schedule (no join verbs): host attention in line

    def open(self, blocks: list[MicroBlock]) -> None:
        """Make the micro-batches' states (each block's rows sorted by length, at most policy.block_size).
        The working memory of one GPU batch is reserved once: a stage computes one micro-batch at a time."""
        if self.micro:
            raise RuntimeError("StageExecutor.open: the previous micro-batches are still open")
        for n, (prompts, max_new, _) in enumerate(blocks):
            if not prompts or len(prompts) > self.policy.block_size or len(prompts) != len(max_new):
                raise ValueError(f"StageExecutor.open: micro-batch {n} has {len(prompts)} prompts and "
                                 f"{len(max_new)} max_new_tokens (block size {self.policy.block_size})")
        batches = [self._batches(prompts, max_new) for prompts, max_new, _ in blocks]
        reserve_positions(self.family, max(b.length for group in batches for b in group), self.device, self.dtype)
        work = max(self._working_bytes(b) for b in batches)
        self._running = [(self._shape(b, max(max_new)), f".m{m}") for m, (b, (_, max_new, _)) in
                         enumerate(zip(batches, blocks))]
        self._plan_buffers()
        self.budget.reserve(Tier.GPU, work, "working memory of one GPU batch")
        self._work = work
        self.stats = {"prefill_s": 0.0, "decode_s": 0.0, "steps": 0}
        try:
            with torch.inference_mode():
                self.micro = [self._block_state(b, select, tag=f".m{m}")
                              for m, (b, (_, _, select)) in enumerate(zip(batches, blocks))]
        except BaseException:
            self.close_blocks()
            raise

    def done(self, m: int) -> bool:
        return self.micro[m].all_done

    def step(self, i: int, m: int, hidden: list[Hidden] | None,
             results: dict[int, StepResult] | None) -> list[Hidden] | dict[int, StepResult]:
        """Run step i of micro-batch m over this stage's layers. `results`: the last stage's results of step
        i-1 to replay first (None on the last stage, which made them, and at step 0); `hidden`: the previous
        stage's output per GPU batch (None on the first stage). Returns the hidden states per GPU batch for
        the next stage, or on the last stage the head's results per GPU batch that ran."""
        blk = self.micro[m]
        self.block = blk
        try:
            with torch.inference_mode():
                for k, result in (results or {}).items():
                    self._apply_step(k, result)
                if hidden is not None:    # a GPU batch whose rows all ended has nothing to carry
                    blk.hidden = [None if b.done else to_device(h, self.device) for h, b in zip(hidden, blk.batches)]
                blk.results = {}
                if not blk.all_done:
                    K = len(blk.batches)
                    self._run_actions(step_actions(i, len(self.specs), K, paged=K > 1))
                    self._sync(None)
                if self.stage.last:
                    return dict(blk.results)
                return [None if b.done else blk.acts.ready(k, blk.acts.load(k, h, self.transfers))
                        for k, (h, b) in enumerate(zip(blk.hidden, blk.batches))]
        finally:
            self.block = None

    def close_blocks(self) -> None:
        """Wait for every micro-batch's transfers and drop their states and the working-memory reservation."""
        for blk in self.micro:
            self.block = blk
            self._drain()
        self.block = None
        self.micro = []
        if self._work:
            self.budget.release(Tier.GPU, self._work, "working memory of one GPU batch")
            self._work = 0

    def close(self) -> None:
        self.close_blocks()
        super().close()
