"""Run a validated `Pipeline`: source -> steps -> sink, streaming the last llm_map's results to the sink.

Steps before the last `llm_map` run on the whole table (an earlier llm_map is collected in row order).
The last llm_map streams: each batch of finished rows is joined to its input rows, passed through the
row-wise steps after it (filter, parse, select) and written to the sink's staging file at once. When a
non-row-wise step (sql, dedupe) follows it, its results are collected first and the tail runs on the
whole table. The sink is published atomically at the end (see `sinks.py`); with the result cache on, a
rerun after a crash recomputes only the rows that had not finished.

Job-level problems raise: `SourceError`, `StepError`, `TemplateError` (the pipeline does not fit its
data: the CLI exits 2), `SinkError` or the engine's own exception (exit 1). Everything that can fail without
generating fails first: every step is checked against the data's columns (`preflight.check_pipeline`) and
the sink's folder is created and checked writable before the source is read. Per-row failures are counted
in `RunResult.failed_rows`, never raised. Every finished run writes its report beside the sink
(`llmops.report`: figures, failures by reason, throughput over time, where the time went, the plan's
predicted vs the measured speed); `RunResult.report` is its path. With `allow_errors=False`, a run with
failed rows does not replace an existing sink: its rows are published beside it (`SinkWriter.commit(hold=
True)`) and `RunResult.held` says where.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import pyarrow as pa

from llmops.core import CacheDir, MapRun, map_table, output_schema, write_json_atomic
from llmops.pipeline.preflight import check_pipeline
from llmops.pipeline.semantic_steps import StepContext, is_semantic, run_semantic
from llmops.pipeline.sinks import SinkWriter
from llmops.pipeline.sources import read_source
from llmops.pipeline.spec import ROW_WISE, LlmMapStep, Pipeline
from llmops.pipeline.steps import ROW_COLUMN, StepError, apply_step, attach_output, map_spec, step_label
from llmops.report import build_report, report_path
from llmops.templates import TemplateError

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """Figures of one pipeline run. failed_rows: rows whose llm_map output is null because of an error or
    a structured output cut by max_new_tokens (summed over llm_map steps); tokens count this run's
    engine work only (cached rows cost none)."""

    name: str
    output: str
    source_rows: int = 0
    rows_written: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cache_hits: int = 0
    failed_rows: int = 0
    seconds: float = 0.0
    llm_steps: list[dict[str, Any]] = field(default_factory=list)
    report: str | None = None
    held: str | None = None     # where the rows went instead of the sink (a failed run kept the sink as it was)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per wall-clock second of the whole run."""
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 2)}

    def __str__(self) -> str:
        where = self.held or self.output
        return (f"{self.name}: {self.source_rows} rows read, {self.rows_written} written to {where} in "
                f"{self.seconds:.1f}s; {self.generated_tokens} tokens generated ({self.tokens_per_s:.1f} tok/s), "
                f"{self.cache_hits} cache hits, {self.failed_rows} failed rows"
                + (f"; report: {self.report}" if self.report else ""))


def cache_setting(pipeline: Pipeline, use_cache: bool) -> CacheDir:
    """The `cache_dir` argument of map_table: False when caching is off, else the pipeline's setting."""
    return False if not use_cache else pipeline.cache_dir


def _with_positions(table: pa.Table) -> pa.Table:
    """`table` with ROW_COLUMN set to each row's position."""
    if ROW_COLUMN in table.column_names:
        table = table.drop_columns([ROW_COLUMN])
    return table.append_column(ROW_COLUMN, pa.array(range(table.num_rows), pa.int64()))


def write_run_report(pipeline: Pipeline, result: RunResult, times: dict[str, float],
                     details: list[dict[str, Any]]) -> None:
    """The run report beside the sink (`llmops.report`), its path in `result.report`; a failure to write it
    is logged and leaves `result.report` None. Shared by the local and the Ray runner."""
    sink = pipeline.sink
    path = report_path(sink.kind, sink.target, sink.table if sink.kind == "database" else None)
    result.report = str(path)
    try:
        write_json_atomic(path, build_report(result.to_dict(), times, details))
    except OSError as exc:
        result.report = None
        log.warning("run report %s: cannot write it: %s", path, exc.strerror)


class _Run:
    """State of one run: the options, the figures and the MapRuns whose summaries feed them."""

    def __init__(self, pipeline: Pipeline, *, limit: int | None, use_cache: bool, progress: bool | None,
                 engine: Any) -> None:
        self.pipeline, self.limit, self.progress, self.engine = pipeline, limit, progress, engine
        self.cache_dir = cache_setting(pipeline, use_cache)
        self.result = RunResult(name=pipeline.name or "pipeline", output=pipeline.sink.target)
        self.details: list[dict[str, Any]] = []        # llm_map steps for the run report
        self.times: dict[str, float] = {"source": 0.0, "sink": 0.0}
        self.streamed = False   # the last llm_map streamed into the sink (its time includes the sink's)
        self.maps: list[tuple[int, MapRun]] = []
        self.semantic: list[tuple[int, Any]] = []  # (step index, SemanticFigures)

    def apply(self, index: int, step: Any, table: pa.Table) -> pa.Table:
        """A whole-table step: a semantic one (llmops.pipeline.semantic_steps) or a table step."""
        if not is_semantic(step):
            return apply_step(index, step, table)
        ctx = StepContext(self.pipeline, self.cache_dir, self.progress, self.engine)
        table, figures = run_semantic(index, step, table, ctx)
        self.semantic.append((index, figures))
        return table

    def start_map(self, index: int, step: LlmMapStep, table: pa.Table) -> MapRun:
        label = step_label(index, step)
        try:
            run = map_table(table, map_spec(step.llm_map, self.pipeline), cache_dir=self.cache_dir,
                            progress=self.progress, engine=self.engine)
        except TemplateError as exc:
            raise TemplateError(f"{label}: {exc}") from None
        self.maps.append((index, run))
        return run

    def write_report(self) -> None:
        """Write the run report beside the sink (`llmops.report`); a failure to write it is logged."""
        if self.streamed and self.details:   # the streamed last step's wall time holds the sink's writes
            split = self.details[-1]["time"]
            split["other"] = max(0.0, split["other"] - self.times["sink"])
        times = {"source": self.times["source"], "sink": self.times["sink"]}
        write_run_report(self.pipeline, self.result, times, self.details)

    def failed_rows(self) -> int:
        """Rows with a null output because of an error or a cut structured output, over every LLM step so far."""
        return (sum(run.summary.errors + run.summary.truncated for _, run in self.maps)
                + sum(fig.report.get("failed_rows", fig.summary.errors + fig.summary.truncated)
                      for _, fig in self.semantic))

    def tally(self) -> None:
        res = self.result
        for index, run in self.maps:
            s = run.summary
            res.generated_tokens += s.generated_tokens
            res.prompt_tokens += s.prompt_tokens
            res.cache_hits += s.cache_hits
            res.failed_rows += s.errors + s.truncated
            res.llm_steps.append({"step": index, "output": self.pipeline.steps[index].llm_map.output,
                                  **s.to_dict(), "failed_examples": run.failed_examples,
                                  "failed_by_reason": dict(run.failed_by_reason)})
            plan = getattr(run.job, "plan", None)
            stats = run.engine_stats
            self.details.append({**res.llm_steps[-1], "failures": dict(run.failures), "timeline": run.timeline,
                                 "throughput": run.clock.to_dict(), "time": run.time_split(),
                                 "engine": stats.to_dict() if stats is not None else None,
                                 "plan": plan.to_dict() if hasattr(plan, "to_dict") else None})
        for index, fig in self.semantic:
            res.generated_tokens += fig.summary.generated_tokens
            res.prompt_tokens += fig.summary.prompt_tokens
            res.cache_hits += fig.summary.cache_hits
            res.failed_rows += fig.report.get("failed_rows", fig.summary.errors + fig.summary.truncated)
            res.llm_steps.append({"step": index, "kind": step_label(index, self.pipeline.steps[index]),
                                  **fig.summary.to_dict(), **fig.report})


def _batches(table: pa.Table, run: MapRun, step: LlmMapStep) -> Iterator[pa.Table]:
    """Joined output batches of a MapRun; one empty batch when the table has no rows."""
    produced = False
    for batch in run:
        produced = True
        yield attach_output(table, batch, step.llm_map)
    if not produced:
        yield attach_output(table, output_schema(run.spec).empty_table(), step.llm_map)


def run_pipeline(pipeline: Pipeline, *, limit: int | None = None, use_cache: bool = True,
                 progress: bool | None = None, engine: Any = None, allow_errors: bool = True) -> RunResult:
    """Run `pipeline` to completion and publish its sink. limit: read at most this many source rows.
    use_cache False: ignore and do not fill the result cache. progress: None = a bar when stderr is a
    TTY. engine: an `engine.LLM`-like object for every llm_map (tests); default: the cached engine.
    allow_errors False: rows failed, so an existing sink is kept and the rows go beside it (`RunResult.held`)."""
    start = time.perf_counter()
    check_pipeline(pipeline)              # every step against the data's columns, before any work
    writer = SinkWriter(pipeline.sink)    # the sink's folder created and writable, before any work
    state = _Run(pipeline, limit=limit, use_cache=use_cache, progress=progress, engine=engine)
    steps = pipeline.steps
    llm_indices = [i for i, s in enumerate(steps) if isinstance(s, LlmMapStep) and not is_semantic(s)]
    last = llm_indices[-1] if llm_indices else -1
    tail = list(enumerate(steps))[last + 1:]
    try:
        table = read_source(pipeline.source, limit=limit)
        state.times["source"] = time.perf_counter() - start
        state.result.source_rows = table.num_rows
        for i, step in enumerate(steps[:max(last, 0)]):
            if isinstance(step, LlmMapStep) and not is_semantic(step):
                ordered = state.start_map(i, step, table).ordered()
                table = attach_output(table, ordered, step.llm_map).drop_columns([ROW_COLUMN])
            else:
                table = state.apply(i, step, table)
        if last < 0:
            parts: Iterator[pa.Table] = iter([_with_positions(table)])
        else:
            parts = _batches(table, state.start_map(last, steps[last], table), steps[last])
        if all(isinstance(s, ROW_WISE) for _, s in tail):
            state.streamed = last >= 0
            for part in parts:
                for i, step in tail:
                    part = apply_step(i, step, part, keep=(ROW_COLUMN,))
                began = time.perf_counter()
                writer.write(part)
                state.times["sink"] += time.perf_counter() - began
        else:
            whole = pa.concat_tables(list(parts)).sort_by(ROW_COLUMN).drop_columns([ROW_COLUMN])
            for i, step in tail:
                whole = state.apply(i, step, whole)
            began = time.perf_counter()
            writer.write(_with_positions(whole))
            state.times["sink"] += time.perf_counter() - began
        began = time.perf_counter()
        state.result.rows_written = writer.commit(hold=not allow_errors and state.failed_rows() > 0)
        state.result.held = writer.held
        state.times["sink"] += time.perf_counter() - began
    except BaseException:
        writer.abort()
        raise
    finally:
        state.tally()
        state.result.seconds = time.perf_counter() - start
    state.write_report()
    return state.result


__all__ = ["RunResult", "StepError", "run_pipeline"]
