"""Ray Data adapter: `map_dataset(ds, spec)` runs an llm_map over a `ray.data.Dataset` on a pool of actors,
one engine each, and returns the dataset with the output column(s) added.

Each actor (`LlmActor`) holds one `llmops.core.Job`: its first batch plans the engine's policy from that
batch's rows, every later batch reuses the plan and the warm executor (one plan per actor, not per batch),
and each batch goes through `llmops.core.map_table`, so dedup, shared prefixes, data-is-data
marking and the result cache work exactly as on one machine. The result cache is a directory every actor
opens (SQLite in WAL mode, safe for the processes of one host; on several hosts give each a shared path
that supports POSIX locks, or one per host): a row finished by a worker that later died is served from the
cache when the batch is retried or the job is rerun. Ray Data restarts a failed actor and retries its
batches (its defaults for actor pools: `max_restarts=-1`, task retries on).

`batch_rows` rows go to an actor per call (default `BATCH_ROWS`: several of a typical plan's blocks, so an
actor's engine fills its blocks); `num_engines` actors run at once, each with `gpus_per_engine` GPUs
(0: CPU actors). Several GPUs: `num_engines` actors of one GPU each are data parallelism across
the cluster; an actor of `gpus_per_engine` N > 1 sees only its N GPUs, so `engine.devices: auto` makes its
engine use all N (data- or pipeline-parallel inside the actor, `engine.parallel`). Order: with `DataContext.execution_options.preserve_order` (the pipeline runner sets it)
rows come out in input order.

This module imports Ray: install the extra with `pip install "llmops-engine[ray]"` (`llmops.install_hint`).
"""
from __future__ import annotations

from typing import Any

import pyarrow as pa
import ray
import ray.data

from llmops.core import CacheDir, Job, MapRun, MapSpec, map_table

BATCH_ROWS = 2048
_META = ("finish_reason", "error", "text", "prompt_tokens", "completion_tokens")


class LlmActor:
    """The callable class Ray Data runs in each actor: one engine and one job for its lifetime."""

    def __init__(self, spec: dict[str, Any], output: str, with_meta: bool, cache_dir: CacheDir,
                 engine_factory: Any = None) -> None:
        self.spec = MapSpec.from_dict(spec)
        self.output, self.with_meta, self.cache_dir = output, with_meta, cache_dir
        engine = engine_factory(self.spec) if engine_factory is not None else None
        self.job = Job(self.spec, engine=engine)

    def map(self, batch: pa.Table) -> MapRun:
        """One batch through the actor's job (planned from its first batch's rows)."""
        if batch.num_rows:
            self.job.prepare(batch)
        return map_table(batch, self.spec, cache_dir=self.cache_dir, progress=False, job=self.job)

    def __call__(self, batch: pa.Table) -> pa.Table:
        result = self.map(batch).ordered()
        out = batch.append_column(self.output, result.column("output"))
        for name in _META if self.with_meta else ():
            out = out.append_column(name, result.column(name))
        return out


class ClusterTooSmall(ValueError):
    """The Ray cluster cannot hold the engine actors asked for (an invalid request: the CLI exits 2)."""


def check_room(num_engines: int, gpus_per_engine: float) -> None:
    """Raise ClusterTooSmall when the running Ray cluster cannot hold `num_engines` engine actors (one CPU each)
    and still run the reads and row-wise steps beside them (one more CPU), or lacks their GPUs: Ray Data
    would otherwise wait for resources forever."""
    have = ray.cluster_resources()
    cpus, gpus = have.get("CPU", 0.0), have.get("GPU", 0.0)
    if cpus < num_engines + 1:
        raise ClusterTooSmall(f"{num_engines} engine actor(s) take {num_engines} CPU(s) and the reads need one more, "
                         f"but the Ray cluster has {cpus:g}: use fewer engines or a larger cluster")
    if gpus < num_engines * gpus_per_engine:
        raise ClusterTooSmall(f"{num_engines} engine(s) x {gpus_per_engine:g} GPU(s) need {num_engines * gpus_per_engine:g} "
                         f"GPUs; the Ray cluster has {gpus:g}")


def check_devices(spec: MapSpec, gpus_per_engine: float) -> None:
    """Raise ValueError when the spec's `devices` names more CUDA devices than an actor is given (Ray makes
    only an actor's own GPUs visible to it, so the engine would not find them)."""
    devices = dict(spec.engine).get("devices")
    if isinstance(devices, (list, tuple)):
        cuda = [d for d in devices if isinstance(d, int) or str(d).startswith("cuda")]
        if len(cuda) > gpus_per_engine:
            raise ValueError(f"engine devices {list(devices)} name {len(cuda)} GPU(s) but each Ray engine actor gets "
                             f"{gpus_per_engine:g} (gpus_per_engine); use devices: auto with gpus_per_engine "
                             f"{len(cuda)}")


def map_dataset(ds: ray.data.Dataset, spec: MapSpec, *, output: str = "llm_output", with_meta: bool = False,
                num_engines: int = 1, gpus_per_engine: float = 0, batch_rows: int = BATCH_ROWS,
                cache_dir: CacheDir = None, engine_factory: Any = None) -> ray.data.Dataset:
    """`ds` with `output` (and, with `with_meta`, finish_reason/error/text/token columns; see
    `llmops.core`) computed by `spec` over every row, on `num_engines` actors.

    The template's placeholders name `ds`'s columns. engine_factory: a picklable `f(spec) -> engine` run in
    each actor (tests; default: the process-wide engine for spec.model/spec.engine). Lazy, like every Ray
    Data transform: nothing runs until the dataset is consumed."""
    if num_engines < 1:
        raise ValueError(f"num_engines must be at least 1, got {num_engines}")
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
    check_devices(spec, gpus_per_engine)
    check_room(num_engines, gpus_per_engine)
    return ds.map_batches(
        LlmActor, batch_format="pyarrow", batch_size=batch_rows, zero_copy_batch=True,
        fn_constructor_kwargs={"spec": spec.to_dict(), "output": output, "with_meta": with_meta,
                               "cache_dir": cache_dir, "engine_factory": engine_factory},
        concurrency=num_engines, num_gpus=gpus_per_engine)


__all__ = ["BATCH_ROWS", "ClusterTooSmall", "LlmActor", "check_devices", "check_room", "map_dataset"]
