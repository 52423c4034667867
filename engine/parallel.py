"""Several devices of one host behind the facade: which devices, which kind of parallelism, and the lanes.

`resolve_devices` turns `LLM(devices=...)` into torch devices: "auto" (every visible CUDA device, else the
one `device`), a list of CUDA indices, or a list of torch device strings (["cpu", "cpu"] runs two "devices"
on the CPU, for tests). `choose_parallel` picks per plan: "data" when the policy keeps every weight on the
gpu tier (the model fits one device's budget: one engine per device over disjoint blocks, no I/O to share),
"pipeline" otherwise (the layers split over the devices, `engine.runtime.pipeline`, FlexGen section 4.4).

Budgets: `gpu_memory` holds on each device; the host is one, so each device's engine (a lane or a stage)
plans and runs within `cpu_memory / N` (`host_share`). A data-parallel `Lanes` runs whole blocks, one per
device at a time, handing the next block to whichever device is free (blocks are cut from rows sorted by
length, so dealing them out keeps the devices equally busy; completions are per row index, so the caller's
order is kept). Neither path retries a block with a smaller batch after an out-of-memory (the
single-device path does): the error propagates.
"""
from __future__ import annotations

import functools
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from engine.policy.model_stats import dtype_bytes
from engine.policy.partition import Parallel, choose_parallel, partition_model
from engine.policy.policy import Policy
from engine.runtime.executor import Executor
from engine.runtime.pipeline import Pipeline
from engine.runtime.stage_executor import StageExecutor, close_on_devices, on_device

__all__ = ["DeviceSpec", "Lanes", "Parallel", "build_pipeline", "choose_parallel", "host_share", "locked",
           "resolve_devices", "run_blocks"]
DeviceSpec = str | Sequence[int | str] | None


def resolve_devices(devices: DeviceSpec, device: torch.device) -> list[torch.device]:
    """The devices an engine runs on (see the module docstring); None: just `device`."""
    if devices is None:
        return [device]
    if isinstance(devices, str):
        if devices != "auto":
            raise ValueError(f"LLM(devices=...): expected 'auto' or a list of devices, got {devices!r}")
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", i) for i in range(n)] if n > 1 else [device]
    out = []
    for d in devices:
        if isinstance(d, bool) or not isinstance(d, (int, str)):
            raise ValueError(f"LLM(devices=...): {d!r} is neither a CUDA index nor a device string")
        dev = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
        if dev.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = 0 if dev.index is None else dev.index
            if index >= count:
                raise ValueError(f"LLM(devices=...): {d!r} names CUDA device {index}, but {count} are visible")
            dev = torch.device("cuda", index)
        out.append(dev)
    if not out:
        raise ValueError("LLM(devices=...): the list is empty")
    return out


def host_share(cpu_memory: int | None, num_devices: int) -> int | None:
    """Each device's engine's share of the host budget."""
    return None if cpu_memory is None else cpu_memory // num_devices


def device_disk_dir(disk_dir: str | Path | None, n: int) -> Path | None:
    """Device n's own folder for the disk tier (its weight files and scratch)."""
    return None if disk_dir is None else Path(disk_dir) / f"device{n}"


def build_pipeline(loaded, policy: Policy, devices: list[torch.device], *, dtype: torch.dtype,
                   gpu_memory: int | None, cpu_memory: int | None, disk_dir: Path | None) -> Pipeline:
    """One stage per device, the layers balanced by their stored weight bytes (`partition_model`)."""
    stages = partition_model(loaded.config, len(devices), dtype_bytes(dtype), policy.compress_weights)
    built: list[StageExecutor] = []
    try:
        for st, dev in zip(stages, devices):
            with on_device(dev):               # placement synchronizes the current device's stream
                built.append(StageExecutor(loaded, policy, st, device=dev, dtype=dtype, gpu_memory=gpu_memory,
                                           cpu_memory=host_share(cpu_memory, len(devices)),
                                           disk_dir=device_disk_dir(disk_dir, st.index)))
    except BaseException:
        close_on_devices(built)
        raise
    return Pipeline(built)


class Lanes:
    """Data parallelism: one executor per device (the same policy), each running whole blocks."""

    def __init__(self, loaded, policy: Policy, devices: list[torch.device], *, dtype: torch.dtype,
                 gpu_memory: int | None, cpu_memory: int | None, disk_dir: Path | None) -> None:
        self.policy = policy
        self.executors: list[Executor] = []
        try:
            for n, dev in enumerate(devices):
                with on_device(dev):
                    self.executors.append(Executor(loaded, policy, device=dev, dtype=dtype, gpu_memory=gpu_memory,
                                                   cpu_memory=host_share(cpu_memory, len(devices)),
                                                   disk_dir=device_disk_dir(disk_dir, n)))
        except BaseException:
            self.close()
            raise

    def run(self, jobs: Sequence[Callable[[Executor], object]]) -> Iterator[tuple[int, object]]:
        """Run every job (a function of a free executor) on the first free device; yield (job index, its
        result) as each ends. The first failure is raised here after the running jobs end; jobs not yet
        started then never start."""
        free: queue.Queue[Executor] = queue.Queue()
        for ex in self.executors:
            free.put(ex)

        def work(job: Callable[[Executor], object]) -> object:
            ex = free.get()
            try:
                with on_device(ex.device):
                    return job(ex)
            finally:
                free.put(ex)

        done: queue.Queue[tuple[int, Future]] = queue.Queue()
        pool = ThreadPoolExecutor(len(self.executors), thread_name_prefix="engine-lane")
        try:
            for n, job in enumerate(jobs):
                pool.submit(work, job).add_done_callback(lambda f, n=n: done.put((n, f)))
            for _ in range(len(jobs)):
                n, future = done.get()
                yield n, future.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def memory_report(self) -> list[dict]:
        return [ex.memory_report() for ex in self.executors]

    def close(self) -> None:
        close_on_devices(self.executors)
        self.executors = []


def _generate_on(prompts: list[list[int]], selector, executor: Executor) -> None:
    """One block on `executor` (a lane's job); `selector` is the block's decoder."""
    executor.generate_block(prompts, selector.max_new_tokens, selector)


def run_blocks(engine: Lanes | Pipeline, prompts: list[list[list[int]]], decoders: list) -> Iterator[int]:
    """Generate block n (`prompts[n]`, rows sorted by length, with its decoder `decoders[n]`, which has
    `max_new_tokens`) for every n; yield n as each block ends. Lanes: each block on the next free device, in
    the order they end; a Pipeline: N blocks at a time as its N micro-batches (N = its stages), in order."""
    if isinstance(engine, Lanes):
        jobs = [functools.partial(_generate_on, p, d) for p, d in zip(prompts, decoders)]
        for n, _ in engine.run(jobs):
            yield n
        return
    S = len(engine.stages)
    for start in range(0, len(prompts), S):
        group = range(start, min(start + S, len(prompts)))
        engine.generate([(prompts[n], decoders[n].max_new_tokens, decoders[n]) for n in group])
        yield from group


def locked(fn: Callable[..., None] | None) -> Callable[..., None] | None:
    """`fn` serialized by a lock (row-finish hooks called from several lanes' threads)."""
    if fn is None:
        return None
    lock = threading.Lock()

    def call(*args) -> None:
        with lock:
            fn(*args)
    return call
