"""The invoice job every product path runs: N distinct invoice e-mails, the pipeline file's llm_map step as
one MapSpec, and one runner per path (engine, `llmops run`, Polars eager and streaming, DuckDB relation and
UDF). Each runner returns {"seconds", "first_result_s", "first_result_note", "non_null_rows", ...}."""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Timer
from benchmarks.operators.engine_probe import StreamProbe

PATHS = ("engine", "pipeline", "pipeline-dry", "pipeline-first", "pipeline-cold", "polars", "polars-streaming", "duckdb-relation", "duckdb-udf")
PIPELINE = ROOT / "pipelines" / "bench_invoices.yaml"
UDF_NAME = "extract_invoice"
OUTPUT = "fields"


def invoice_rows(n: int, offset: int = 0) -> list[dict[str, Any]]:
    """n distinct invoice emails: sample_data/invoices.csv in order, then the same emails with their invoice
    number's digits redrawn (seeded by the row number), so every prompt is distinct and dedup flatters nobody."""
    with open(ROOT / "sample_data" / "invoices.csv", newline="", encoding="utf-8") as f:
        base = [r for r in csv.DictReader(f) if r.get("body")]
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for j in range(offset, offset + n):
        r = base[j % len(base)]
        body, number = r["body"], r.get("label_invoice_number") or ""
        if j >= len(base):
            rng = random.Random(j)
            fresh = re.sub(r"\d", lambda _: str(rng.randrange(10)), number)
            body = body.replace(number, fresh) if number and number in body else f"{body} (ref {j})"
        if body in seen:
            body = f"{body} (ref {j})"
        seen.add(body)
        out.append({"id": j, "vendor": r["vendor"], "body": body})
    return out


def load_step(path: Path) -> dict[str, Any]:
    """The pipeline file's (only) llm_map step, read with PyYAML alone (no pydantic needed)."""
    import yaml

    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    steps = [s["llm_map"] for s in data.get("steps", []) if isinstance(s, dict) and "llm_map" in s]
    if len(steps) != 1:
        raise SystemExit(f"{path}: expected exactly one llm_map step, found {len(steps)}")
    return steps[0]


def _non_null(values: list[Any]) -> int:
    return sum(v is not None for v in values)


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def compiled_paths(path: list[str]) -> None:
    """Byte-compile the checkout's packages and every other folder on `path`, once per process: a machine that
    does not write bytecode as it imports (PYTHONDONTWRITEBYTECODE) would otherwise compile every module
    in every fresh process, seconds an installed package never pays."""
    import compileall

    for entry in path:
        if entry not in _COMPILED:
            folders = [Path(entry) / "engine", Path(entry) / "llmops"] if Path(entry) == ROOT else [Path(entry)]
            for folder in folders:
                if folder.is_dir():
                    compileall.compile_dir(str(folder), quiet=2)   # in this process: it may hold CUDA and threads
            _COMPILED.add(entry)


_COMPILED: set[str] = set()


def run_llmops(argv: list[str], what: str) -> tuple[dict[str, Any], float, dict[str, float]]:
    """Run `llmops *argv` in a fresh Python process (this checkout first on its path): the JSON object it
    prints, its wall seconds and where they went, {"summary_s": spawn to the summary's first line on stdout
    (start-up, imports, the run and its report), "exit_s": from that line to the process's exit (teardown)};
    RuntimeError naming `what` and the end of stderr when it fails. The process's modules are byte-compiled
    first (`compiled_paths`), as `pip install` leaves them."""
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    compiled_paths(path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    err: list[str] = []
    lines: list[str] = []
    summary_at: float | None = None
    with Timer() as t:
        proc = subprocess.Popen([sys.executable, "-m", "llmops.cli", *argv], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        drain = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
        drain.start()
        for line in proc.stdout:
            if summary_at is None and line.lstrip().startswith("{"):
                summary_at = time.perf_counter()
            lines.append(line)
        proc.wait()
        drain.join()
    stdout = "".join(lines)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited {proc.returncode}: {''.join(err)[-2000:]}")
    at = t.start + t.seconds if summary_at is None else summary_at
    split = {"summary_s": round(at - t.start, 3), "exit_s": round(t.start + t.seconds - at, 3)}
    return json.loads(stdout[stdout.index("{"):]), t.seconds, split


class Job:
    """Everything the paths share: args, spec, rows, files, the engine and its probe."""

    def __init__(self, args: argparse.Namespace, step: dict[str, Any], settings: dict[str, Any]) -> None:
        from llmops.core import MapSpec, sampling_params
        from llmops.templates import render_rows

        self.args, self.step, self.settings = args, step, settings
        self.model = args.model_ref
        self.spec = MapSpec(template=step["template"], model=self.model, system=step.get("system"),
                            examples=tuple(step.get("examples") or ()), schema=step.get("schema"),
                            max_new_tokens=args.max_new_tokens, chat=step.get("chat"),
                            engine=tuple(settings.items()))
        self.params = sampling_params(self.spec)
        self.rows = invoice_rows(args.rows)
        self.bodies = [r["body"] for r in self.rows]
        self.prompts = [o.prompt for o in render_rows(self.spec.template, {"body": self.bodies}, len(self.bodies),
                                                      system=self.spec.system, examples=self.spec.examples)]
        if any(p is None for p in self.prompts):
            raise SystemExit("a row did not render")
        self.work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="job_paths_"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.parquet = self.work / "input.parquet"
        self.csv = self.work / "input.csv"
        self._write_inputs()
        self.llm: Any = None
        self.probe: StreamProbe | None = None

    def _write_inputs(self) -> None:
        import pyarrow as pa
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq

        table = pa.table({"id": pa.array([r["id"] for r in self.rows], pa.int64()),
                          "vendor": pa.array([r["vendor"] for r in self.rows], pa.string()),
                          "body": pa.array(self.bodies, pa.string())})
        pq.write_table(table, self.parquet)
        pacsv.write_csv(table, self.csv)

    def generation_kwargs(self) -> dict[str, Any]:
        """The adapters' keyword arguments that make the same MapSpec as `self.spec`."""
        s = self.spec
        return dict(model=s.model, system=s.system, examples=[dict(e) for e in s.examples], schema=s.schema,
                    max_new_tokens=s.max_new_tokens, chat=s.chat, engine_settings=dict(s.engine), cache_dir=False,
                    progress=False)

    # -- engine
    def run_engine(self) -> dict[str, Any]:
        from llmops.core import output_type
        from llmops.structured import parse_json_output

        out: list[Any] = [None] * len(self.prompts)
        with Timer() as t:
            for group in self.llm.stream(self.prompts, self.params):
                t.mark()
                for i, c in group:
                    out[i] = c
        typ = output_type(self.spec)
        good = 0
        for c in out:
            if c is not None and c.finish_reason == "stop":
                try:
                    parse_json_output(c.text, self.spec.schema, typ)
                    good += 1
                except ValueError:
                    pass
        prompt_tokens = [int(c.prompt_tokens) for c in out if c is not None]
        self.prompt_tokens = prompt_tokens
        return {"seconds": t.seconds, "first_result_s": t.first, "first_result_note": "first stream group",
                "non_null_rows": good, "rows_out": sum(c is not None for c in out),
                "finish_reasons": _count(c.finish_reason for c in out if c is not None)}

    # -- pipeline (llmops run, in-process)
    def run_pipeline(self) -> dict[str, Any]:
        import pyarrow.parquet as pq
        from click.testing import CliRunner

        from llmops.cli import main as cli_main
        from llmops.pipeline import sinks
        from llmops.pipeline.load import load_pipeline
        from llmops.pipeline.steps import map_spec

        sink = self.work / "pipeline_out.parquet"
        argv = self.pipeline_argv(sink)
        overrides = [argv[i + 1] for i, word in enumerate(argv) if word == "--set"]
        pipeline = load_pipeline(self.args.pipeline, overrides=[f"model={json.dumps(self.model)}", *overrides])
        same = map_spec(pipeline.steps[0].llm_map, pipeline) == self.spec
        original = sinks.SinkWriter.write
        first: list[float] = []

        def write(writer: Any, table: Any) -> None:
            original(writer, table)
            if not first and table.num_rows:
                first.append(time.perf_counter())

        sinks.SinkWriter.write = write  # type: ignore[method-assign]
        try:
            with Timer() as t:
                result = CliRunner().invoke(cli_main, argv, catch_exceptions=True)
        finally:
            sinks.SinkWriter.write = original  # type: ignore[method-assign]
        if result.exit_code != 0 or result.exception is not None and not isinstance(result.exception, SystemExit):
            raise RuntimeError(f"llmops run exited {result.exit_code}: {result.output[-2000:]}"
                               + ("" if result.exception is None else f" ({result.exception!r})"))
        stdout = getattr(result, "stdout", result.output)
        summary = json.loads(stdout[stdout.index("{"):])
        table = pq.read_table(sink)
        return {"seconds": t.seconds, "first_result_s": first[0] - t.start if first else None,
                "first_result_note": "first batch written to the sink's staging file",
                "non_null_rows": table.num_rows - table.column(OUTPUT).null_count, "rows_out": table.num_rows,
                "same_spec_as_engine": same, "pipeline_summary": summary, "argv": ["llmops", *argv]}

    def pipeline_argv(self, sink: Path) -> list[str]:
        """`llmops run` of the pipeline file over the job's rows into `sink`, with the job's settings."""
        os.environ["LLMOPS_BENCH_INPUT"] = str(self.csv)
        os.environ["LLMOPS_BENCH_OUTPUT"] = str(sink)
        overrides = [f"steps.0.llm_map.max_new_tokens={self.spec.max_new_tokens}",
                     *(f"engine.{k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in self.settings.items())]
        return ["run", str(self.args.pipeline), "--no-cache", "--json", "--allow-errors", "--no-progress",
                "--model", self.model, *(x for o in overrides for x in ("--set", o))]

    # -- pipeline-dry (`llmops run --dry-run` in a fresh process: the plan it shows, for the cold run to match)
    def run_pipeline_dry(self) -> dict[str, Any]:
        argv = [*self.pipeline_argv(self.work / "pipeline_dry_out.parquet"), "--dry-run"]
        argv.remove("--allow-errors")
        shown, seconds, _ = run_llmops(argv, "llmops run --dry-run")
        return {"seconds": seconds, "first_result_s": None, "peak_device_gib": None, "peak_reserved_gib": None,
                "first_result_note": "a dry run generates nothing", "run_plans": [shown.get("job_plan")],
                "argv": ["llmops", *argv]}

    # -- pipeline-first: pipeline-cold with the plan cache emptied first (the first run of a job on a machine
    #    whose hardware profile is known: planning included)
    def run_pipeline_first(self) -> dict[str, Any]:
        from engine.calibrate.planning.cache import plan_dir

        shutil.rmtree(plan_dir(), ignore_errors=True)
        return self.run_pipeline_cold("pipeline_first_out.parquet")

    # -- pipeline-cold (llmops run in a fresh process: model load, planning and the run, end to end)
    def run_pipeline_cold(self, name: str = "pipeline_cold_out.parquet") -> dict[str, Any]:
        import pyarrow.parquet as pq

        sink = self.work / name
        argv = self.pipeline_argv(sink)
        summary, seconds, split = run_llmops(argv, "llmops run")
        table = pq.read_table(sink)
        report = Path(summary["report"]) if summary.get("report") else None
        steps = json.loads(report.read_text())["llm_steps"] if report is not None and report.is_file() else []
        pipeline_s = float(summary.get("seconds") or 0.0)
        return {"seconds": seconds, "first_result_s": None, "peak_device_gib": None, "peak_reserved_gib": None,
                "run_plans": [step.get("plan") for step in steps],
                "first_result_note": "a separate process: the first result is not observable here",
                "non_null_rows": table.num_rows - table.column(OUTPUT).null_count, "rows_out": table.num_rows,
                # the process's wall seconds: outside the pipeline's clock until the summary prints (start-up,
                # imports, the run report), the pipeline, after the summary (teardown); each llm_map step's
                # split and its blocks' finish times
                "process_split_s": {"before_pipeline": round(split["summary_s"] - pipeline_s, 3),
                                    "pipeline": round(pipeline_s, 3), "after_summary": split["exit_s"]},
                "step_time_splits": [step.get("time") for step in steps],
                "step_timelines": [step.get("timeline") for step in steps],
                "pipeline_summary": summary, "argv": ["llmops", *argv]}

    # -- polars
    def _polars_frame_and_expr(self):
        import polars as pl

        import llmops

        df = pl.DataFrame({"id": [r["id"] for r in self.rows], "body": self.bodies})
        expr = llmops.llm_map(self.spec.template, **self.generation_kwargs()).alias(OUTPUT)
        return pl, df, expr

    def run_polars(self) -> dict[str, Any]:
        pl, df, expr = self._polars_frame_and_expr()
        with Timer() as t:
            out = df.with_columns(expr)
        return {"seconds": t.seconds, "first_result_s": t.seconds,
                "first_result_note": "eager: the frame is the first result", "rows_out": out.height,
                "non_null_rows": out.height - out[OUTPUT].null_count()}

    def run_polars_streaming(self) -> dict[str, Any]:
        import pyarrow.parquet as pq

        pl, df, expr = self._polars_frame_and_expr()
        lf = df.lazy().with_columns(expr)
        target = self.work / "polars_streaming.parquet"
        variant = self.args.polars_streaming
        if variant == "sink_batches" and not hasattr(pl.LazyFrame, "sink_batches"):
            variant = "sink_parquet"
        first: list[float] = []
        counts = {"rows": 0, "non_null": 0, "batches": 0}
        writer: list[Any] = []

        def on_batch(batch: Any) -> None:
            if not first:
                first.append(time.perf_counter())
            table = batch.to_arrow()
            if not writer:
                writer.append(pq.ParquetWriter(target, table.schema))
            writer[0].write_table(table)
            counts["batches"] += 1
            counts["rows"] += batch.height
            counts["non_null"] += batch.height - batch[OUTPUT].null_count()

        with Timer() as t:
            if variant == "sink_batches":
                lf.sink_batches(on_batch, engine="streaming", maintain_order=not self.args.unordered)
                if writer:
                    writer[0].close()
            elif variant == "sink_parquet":
                lf.sink_parquet(target, engine="streaming", maintain_order=not self.args.unordered)
            else:
                out = lf.collect(engine="streaming")
        if variant == "sink_parquet":
            table = pq.read_table(target)
            counts.update(rows=table.num_rows, non_null=table.num_rows - table.column(OUTPUT).null_count)
        elif variant == "collect":
            counts.update(rows=out.height, non_null=out.height - out[OUTPUT].null_count())
        observed = variant == "sink_batches"
        return {"seconds": t.seconds, "first_result_s": first[0] - t.start if observed and first else None,
                "first_result_note": ("first batch handed to sink_batches' callback" if observed else
                                      f"{variant}: not observable before the query ends"),
                "variant": variant, "maintain_order": not self.args.unordered,
                "batches": counts["batches"] if observed else None,
                "rows_out": counts["rows"], "non_null_rows": counts["non_null"]}

    # -- duckdb
    def _fetch(self, rel: Any) -> tuple[int, int, float | None, int]:
        """(rows, non-null outputs, seconds of the first batch since `start`, batches) of a DuckDB relation."""
        how = self.args.duckdb_fetch
        if how == "fetchall":
            rows = rel.fetchall()
            col = [r[0] for r in rows]
            return len(col), _non_null(col), None, 1
        if how == "arrow":
            table = rel.to_arrow_table()
            return table.num_rows, table.num_rows - table.column(OUTPUT).null_count, None, 1
        reader = rel.to_arrow_reader(batch_size=self.args.duckdb_batch)
        n = good = batches = 0
        first = None
        for batch in reader:
            if first is None:
                first = time.perf_counter()
            batches += 1
            n += batch.num_rows
            good += batch.num_rows - batch.column(batch.schema.get_field_index(OUTPUT)).null_count
        return n, good, first, batches

    def run_duckdb_relation(self) -> dict[str, Any]:
        from llmops.duckdb import map_relation

        con = self._connect()
        query = f"SELECT id, body FROM read_parquet('{self.parquet}')"
        with Timer() as t:
            rel = map_relation(con, query, self.spec.template, output=OUTPUT, **self.generation_kwargs())
            n, good, first, batches = self._fetch(rel.select(OUTPUT) if self.args.duckdb_fetch == "fetchall" else rel)
        return self._duck_result(t, n, good, first, batches, con)

    def run_duckdb_udf(self) -> dict[str, Any]:
        from llmops.duckdb import register

        con = self._connect()
        kw = self.generation_kwargs()
        register(con, name=UDF_NAME, template=self.spec.template, **kw)
        query = f"SELECT {UDF_NAME}(body) AS {OUTPUT} FROM read_parquet('{self.parquet}')"
        with Timer() as t:
            n, good, first, batches = self._fetch(con.sql(query))
        return {**self._duck_result(t, n, good, first, batches, con), "query": query}

    def _connect(self) -> Any:
        import duckdb

        con = duckdb.connect()
        if self.args.unordered:   # DuckDB passes results on only once its ~1 MB result buffer fills, otherwise
            con.execute("SET preserve_insertion_order = false; SET streaming_buffer_size = '1kB'")
        return con

    def _duck_result(self, t: Timer, n: int, good: int, first: float | None, batches: int, con: Any) -> dict[str, Any]:
        how = self.args.duckdb_fetch
        threads = con.execute("SELECT current_setting('threads')").fetchone()[0]
        con.close()
        return {"seconds": t.seconds, "first_result_s": (first - t.start) if first is not None else t.seconds,
                "first_result_note": (f"first Arrow batch ({self.args.duckdb_batch} rows) read from the result"
                                      if how == "reader" else f"{how}: the whole result is the first result"),
                "variant": how, "batches": batches, "rows_out": n, "non_null_rows": good, "duckdb_threads": threads,
                "preserve_insertion_order": not self.args.unordered,
                "streaming_buffer_size": "1kB" if self.args.unordered else "default"}

