"""Run a validated `Pipeline` on Ray Data (`llmops run FILE --runner ray`): the same steps, the same sink,
one engine per actor.

- Source: a parquet file is read by Ray Data (`ray.data.read_parquet`, sharded by file and row group); csv
  and jsonl files, a DuckDB `query` and a `table` are read here with DuckDB, exactly as the local runner
  reads them (its type inference decides what a template renders, so both runners see the same values),
  and handed over as Arrow.
- Steps: row-wise steps (filter, parse, select) run on each batch as Ray Data transforms (DuckDB per
  batch); `llm_map` runs on an actor pool (`llmops.ray`: one engine, one job and one plan per actor); a
  step that needs the whole table (sql, dedupe, and the semantic operators llm_filter / llm_reduce /
  resolve / llm_join or an llm_map with `validate` rules, which run on the driver's engine) gathers the
  dataset here, runs, and hands it back.
- Sink: the driver streams the dataset's batches, in input order (`preserve_order`), into the same
  `SinkWriter` as the local runner: staged as they come, published atomically at the end.
- Durability: every actor stores finished rows in the pipeline's result cache (one directory, SQLite in WAL
  mode: one host, or a path all hosts share); Ray restarts a dead actor and retries its batch, and a rerun
  after a crash computes only what is missing.

The figures of the run (`RunResult`) add up what every actor's job did, through a small tally actor; the
run report JSON is written beside the sink as on the local runner.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import pyarrow as pa
import ray
import ray.data

from llmops.core import RunSummary
from llmops.pipeline.runner import RunResult, cache_setting, write_run_report
from llmops.pipeline.preflight import check_pipeline
from llmops.pipeline.semantic_steps import StepContext, is_semantic, run_semantic
from llmops.pipeline.sinks import SinkWriter
from llmops.pipeline.sources import count_source_rows, read_source
from llmops.pipeline.spec import ROW_WISE, LlmMap, LlmMapStep, Pipeline, Source
from llmops.pipeline.steps import ROW_COLUMN, apply_step, attach_output, map_spec
from llmops.ray import BATCH_ROWS, LlmActor, check_devices, check_room



@ray.remote(num_cpus=0)
class _Tally:
    """Adds up the per-batch summaries of every actor of one run."""

    def __init__(self) -> None:
        self.total = RunSummary(calls=0)

    def add(self, figures: dict[str, Any]) -> None:
        self.total.add(RunSummary(**figures))

    def result(self) -> dict[str, Any]:
        return asdict(self.total)


class _StepActor(LlmActor):
    """An llm_map step's actor: the step's output column(s) attached like the local runner's, and each
    batch's figures sent to the run's tally."""

    def __init__(self, spec: dict[str, Any], step: LlmMap, cache_dir: Any, tally: Any,
                 engine_factory: Any = None) -> None:
        super().__init__(spec, "llm_output", False, cache_dir, engine_factory)
        self.step, self.tally = step, tally

    def __call__(self, batch: pa.Table) -> pa.Table:
        run = self.map(batch)
        out = attach_output(batch, run.ordered(), self.step).drop_columns([ROW_COLUMN])
        # waited for: once the driver holds every batch, the tally holds every batch's figures (a call left in
        # flight could land after the driver's `result`, and the run would count too few tokens)
        ray.get(self.tally.add.remote(asdict(run.summary)))
        return out


def _read(source: Source, limit: int | None) -> tuple[ray.data.Dataset, int]:
    """The source as a dataset and its row count (a parquet file's from its metadata, not a second read)."""
    if source.kind == "parquet" and source.limit is None:
        ds = ray.data.read_parquet(source.parquet)
        return (ds.limit(limit) if limit is not None else ds), count_source_rows(source, limit=limit)
    table = read_source(source, limit=limit)
    return ray.data.from_arrow(table), table.num_rows


def _row_wise(index: int, step: Any) -> Any:
    def apply(batch: pa.Table) -> pa.Table:
        return apply_step(index, step, batch)
    return apply


def _failed_rows(figures: dict[str, Any]) -> int:
    """Rows whose llm_map output is null because of an error or a cut, from the actors' summed figures."""
    return figures["errors"] + figures["truncated"]


def _whole(ds: ray.data.Dataset) -> pa.Table:
    tables = [ray.get(ref) for ref in ds.to_arrow_refs()]
    tables = [t for t in tables if t.num_rows] or tables[:1]
    return pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({})


def run_pipeline_ray(pipeline: Pipeline, *, limit: int | None = None, use_cache: bool = True,
                     address: str | None = None, num_engines: int = 1, gpus_per_engine: float = 0,
                     batch_rows: int = BATCH_ROWS, engine_factory: Any = None,
                     allow_errors: bool = True) -> RunResult:
    """Run `pipeline` on Ray (see module docstring) and publish its sink. address: a Ray cluster
    (`ray.init(address=...)`; None: the running instance, else a local one). engine_factory: a picklable
    `f(spec) -> engine` run in each actor (tests). With `allow_errors=False`, a run with failed rows does not
    replace an existing sink: its rows are published beside it (`SinkWriter.commit(hold=True)`), as the local
    runner does."""
    start = time.perf_counter()
    check_pipeline(pipeline)              # every step against the data's columns, before any work
    writer = SinkWriter(pipeline.sink)    # the sink's folder created and writable, before any work
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    check_room(num_engines, gpus_per_engine)
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    result = RunResult(name=pipeline.name or "pipeline", output=pipeline.sink.target)
    cache_dir = cache_setting(pipeline, use_cache)
    tally = _Tally.remote()
    ds, result.source_rows = _read(pipeline.source, limit)
    semantic = []
    for i, step in enumerate(pipeline.steps):
        if is_semantic(step):       # whole-table LLM operators (and validated maps) run here, on the driver
            table, figures = run_semantic(i, step, _whole(ds), StepContext(pipeline, cache_dir, False, None))
            semantic.append(figures.summary)
            ds = ray.data.from_arrow(table)
        elif isinstance(step, LlmMapStep):
            spec = map_spec(step.llm_map, pipeline)
            check_devices(spec, gpus_per_engine)
            ds = ds.map_batches(
                _StepActor, batch_format="pyarrow", batch_size=batch_rows, zero_copy_batch=True,
                fn_constructor_kwargs={"spec": spec.to_dict(), "step": step.llm_map,
                                       "cache_dir": cache_dir, "tally": tally, "engine_factory": engine_factory},
                concurrency=num_engines, num_gpus=gpus_per_engine)
        elif isinstance(step, ROW_WISE):
            ds = ds.map_batches(_row_wise(i, step), batch_format="pyarrow", batch_size=None)
        else:
            ds = ray.data.from_arrow(apply_step(i, step, _whole(ds)))
    rows, began = 0, time.perf_counter()
    try:
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
            writer.write(table.append_column(ROW_COLUMN, pa.array(range(rows, rows + table.num_rows), pa.int64())))
            rows += table.num_rows
        failed = _failed_rows(ray.get(tally.result.remote()))
        result.rows_written = writer.commit(hold=not allow_errors and failed > 0)
        result.held = writer.held
    except BaseException:
        writer.abort()
        raise
    finally:
        summed = RunSummary(**ray.get(tally.result.remote()))
        for figures in semantic:
            summed.add(figures)
        total = asdict(summed)
        result.generated_tokens, result.prompt_tokens = total["generated_tokens"], total["prompt_tokens"]
        result.cache_hits, result.failed_rows = total["cache_hits"], _failed_rows(total)
        result.llm_steps = [{"step": "all", **total}]
        result.seconds = time.perf_counter() - start
    # the steps overlap inside one streaming dataset: the time splits only into setup and the streamed rest,
    # and the llm_map figures are the sum over every actor
    write_run_report(pipeline, result, {"setup": began - start, "ray_dataset_and_sink": time.perf_counter() - began},
                     [])
    return result


__all__ = ["run_pipeline_ray"]
