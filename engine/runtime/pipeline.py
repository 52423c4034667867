"""`Pipeline`: pipeline-parallel generation over several devices of one host (FlexGen section 4.4).

The decoder layers are split into stages (`engine.policy.partition`), one `StageExecutor` per device, each
with its own budget, weight homes, arena and streams. Generation runs M micro-batches (M blocks of the
policy) through the stages in `engine.runtime.pipeline_schedule`'s order, one thread per stage; hidden
states pass from stage to stage as device-to-device copies inside this one process, and the last stage's
step results go back to the first (whose embedding needs the picked tokens) and on down the chain.

Why threads in one process and not NCCL through `torch.distributed`: every stage's work is already
asynchronous CUDA (kernels, copies on side streams, waits that release the GIL), one process keeps the
facade, the decoders and the token selection where they are (the last stage's thread calls the selectors,
so they are never used from two threads), a cross-device `Tensor.to` is ordered on both devices' streams by
torch, and there is no process group to set up or tear down. The hidden states crossing a stage boundary
are one [b, s, h] tensor per GPU batch and step, small next to the weights a stage streams. This choice is
not measured against NCCL.

Messages are FIFO per inbox in the schedule's order; a micro-batch whose rows all ended is announced once
along the chain (`_ENDED`) and skipped from then on; a failing stage posts `_ABORT` to every inbox so no
thread waits forever, and `generate` re-raises the first error.
"""
from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from engine.runtime.pipeline_schedule import stage_order
from engine.runtime.stage_executor import MicroBlock, StageExecutor, close_on_devices, on_device

_ENDED = "ended"      # payload: micro-batch m's rows have all ended
_ABORT = "abort"      # another stage failed


class _Aborted(Exception):
    pass


class Pipeline:
    """Stages in order (stage 0 holds the embedding, the last the head). `close()` frees every stage."""

    def __init__(self, stages: list[StageExecutor]) -> None:
        if not stages or not stages[0].stage.first or not stages[-1].stage.last:
            raise ValueError("Pipeline: stages must run from the one holding the embedding to the one holding the head")
        self.stages = stages

    @property
    def policy(self):
        return self.stages[0].policy

    def generate(self, blocks: list[MicroBlock]) -> None:
        """Generate every block (a micro-batch: prompts sorted by length, at most the policy's block size,
        its max_new_tokens and its selector) to the end; results live in the selectors, as for
        `Executor.generate_block`. The selectors are called from the last stage's thread only."""
        if not blocks:
            return
        num_steps = max(max(n) for _, n, _ in blocks)
        S = len(self.stages)
        inbox: list[queue.Queue] = [queue.Queue() for _ in range(S)]
        errors: list[BaseException] = []
        try:
            for st in self.stages:
                with on_device(st.device):
                    st.open(blocks)
            threads = [threading.Thread(target=self._run_stage, name=f"pipeline-stage-{s}",
                                        args=(s, num_steps, len(blocks), inbox, errors)) for s in range(S)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for st in self.stages:
                with on_device(st.device):
                    st.close_blocks()
        real = [e for e in errors if not isinstance(e, _Aborted)]
        if errors:
            raise (real or errors)[0]

    def _run_stage(self, s: int, num_steps: int, num_micro: int, inbox: list[queue.Queue],
                   errors: list[BaseException]) -> None:
        st, S = self.stages[s], len(self.stages)
        last = s == S - 1
        ended: set[int] = set()

        def receive(i: int, m: int) -> Any:
            got_i, got_m, payload = inbox[s].get()
            if payload == _ABORT:
                raise _Aborted()
            if (got_i, got_m) != (i, m):
                raise RuntimeError(f"pipeline stage {s}: expected step {i} of micro-batch {m}, got {got_i}/{got_m}")
            return payload

        def send(to: int, i: int, m: int, payload: Any) -> None:
            inbox[to].put((i, m, payload))

        try:
            if st.device.type == "cuda":
                torch.cuda.set_device(st.device)       # this thread's current device for its whole life
            for i, m in stage_order(num_steps, num_micro):
                if m in ended:
                    continue
                hidden = results = None
                if s > 0 or i > 0:
                    payload = receive(i, m)
                    if payload == _ENDED:
                        ended.add(m)
                        if s + 1 < S - 1:
                            send(s + 1, i, m, _ENDED)
                        continue
                    if s == 0:
                        results = payload
                    else:
                        hidden, results = payload
                out = st.step(i, m, hidden, None if last else results)
                if not last:
                    send(s + 1, i, m, (out, results if s + 1 < S - 1 else None))
                elif st.done(m):
                    ended.add(m)
                    if i + 1 < num_steps and S > 1:
                        send(0, i + 1, m, _ENDED)
                elif i + 1 < num_steps:
                    send(0, i + 1, m, out)
        except BaseException as err:    # every stage must stop: the others may be waiting on this one
            errors.append(err)
            for q in inbox:
                q.put((-1, -1, _ABORT))

    def memory_report(self) -> list[dict]:
        """Each stage's `Executor.memory_report()`, in stage order."""
        return [st.memory_report() for st in self.stages]

    def close(self) -> None:
        close_on_devices(self.stages)
