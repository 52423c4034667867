"""Every product path against the engine directly: the same N invoice rows, the same prompts, one process.

    python benchmarks/job_paths.py --model .bench_assets/tiny_model --rows 64 --max-new-tokens 16 \
        --paths engine,pipeline,polars,polars-streaming,duckdb-relation,duckdb-udf --out /tmp/job_paths.jsonl
    python benchmarks/job_paths.py --model smollm2-135m-instruct --rows 200 --fresh \
        --out benchmarks/results/job_paths_cpu.jsonl                      # the committed CPU comparison
    # GPU (defaults there: 10,000 rows, --gpu-memory 16GiB), one device call per group of paths:
    python benchmarks/job_paths.py --model /tmp/llama_1b --paths engine,polars,polars-streaming --out $OUT/jp.jsonl
    python benchmarks/job_paths.py --model /tmp/llama_1b --paths engine,duckdb-relation,duckdb-udf,pipeline ...

Paths (each one job over all N rows, result cache off everywhere):
- engine: `LLM.stream(prompts, params)` on the engine the operator layer caches for these settings, with the
  prompts llmops itself renders (`llmops.templates.render_rows` + `llmops.core.sampling_params` of the MapSpec
  built from the pipeline file's llm_map step: same chat messages, few-shot turns and json_schema);
- pipeline: `llmops run pipelines/bench_invoices.yaml --no-cache --json --allow-errors` in-process (click's
  CliRunner, so the same cached engine serves it and torch's peak can be read), CSV source of the N rows,
  parquet sink;
- polars: eager `df.with_columns(llmops.llm_map(...).alias("fields"))`;
- polars-streaming: `df.lazy().with_columns(...)` through the streaming engine: `sink_batches` writing each
  batch to a parquet file (first_result_s = the first batch), or `--polars-streaming sink_parquet|collect`
  (first_result_s null: not observable);
- duckdb-relation: `llmops.duckdb.map_relation(con, "SELECT * FROM read_parquet(...)", ...)`;
- duckdb-udf: `llmops.duckdb.register(con, name="extract_invoice", template=..., ...)` then
  `SELECT extract_invoice(body) FROM read_parquet(...)`, both DuckDB results read through an Arrow reader
  (`--duckdb-fetch reader`: first_result_s = the first batch) or fetched whole (`arrow`, `fetchall`).
`--unordered` lets results arrive out of order (Polars sinks with maintain_order=False, DuckDB with
preserve_insertion_order=false and
streaming_buffer_size='1kB'); by default both keep order and so pass on nothing before earlier rows are done.
Before the paths an untimed warm-up plans the job's workload once (`LLM.plan` over all N prompts, when the
engine has it) and generates 8 tokens (`--warmup-new-tokens`) for one block of other rows (`--warmup-rows`,
default the plan's block size up to `--warmup-cap`) with that plan, so neither planning nor building the
executor and its batch buffers is charged to whichever path runs first (`warmup_s`, `warmup` in every record).
`engine` always runs first. `--policy` (a Policy as JSON) runs every path on that fixed plan, set as the
engine setting `policy` (a pipeline's `engine.policy`), instead of the plan "auto" makes for the job.

Output: one JSON object per path, appended as a line to --out (JSONL; default
benchmarks/results/job_paths_<device>.jsonl; `--fresh` empties it first) as soon as the path finishes, so a
run killed part-way keeps the finished paths. Fields: run_id (shared by the records of one invocation), path,
system "llmops", rows, seconds, rows_per_h, tokens_per_s, first_result_s (+ first_result_note), ratio_to_engine
(rows_per_h over the engine record's of the same run_id; with `--interleave` the engine runs before and
after every path, ratio_to_engine is against the one just before and ratio_to_engine_bracketed against the
mean of both, rewritten into the file atomically), peak_device_gib / peak_reserved_gib (torch's peaks
since the path started; null on CPU), gpu_memory_gib, device, machine, commit, command, workload, model (its
shape, with num_local_experts and int4: the checkpoint's AWQ/GPTQ tag, e.g. awq-g128, null for float weights),
non_null_rows (rows whose output struct is non-null), generated_tokens, engine_calls, engine_first_block_s
(when the engine finished its first block, seen from inside), plans (the engine's plan(s) used),
prefill_ahead (whether the plan(s) of the path's engine calls had `Policy.prefill_ahead`: true / false, or
the list of flags per plan when they differ; null when no plan was seen), engine_stats (the engine's
`EngineStats` over the path, `stats.since` a snapshot taken at its start: blocks, prefilled_ahead (blocks
whose prefill ran on the previous block's decode), steps, generated_tokens, plan_s, place_s, prefill_s,
decode_s, grammar_mask_s, callback_s; null for an engine without `stats`), warmup_s, load_s, engines_cached,
versions, error (a path that failed; the others still run).
The pipeline file's llm_map step gives template, system, examples, schema and `chat` (e.g.
`--pipeline pipelines/bench_invoices_ahead.yaml`: the invoice workload without a shared prompt prefix or
few-shot turns).

The engine is observed by wrapping the instance's `stream` (a generator pass-through counting groups, tokens
and calls) and, for the pipeline, `SinkWriter.write` (time of the first batch written to the staging file);
both are undone at the end and cost the same on every path. `--engine-again` runs the engine path once more
at the end (repeat 2) to show drift; each record has the 1-minute load average at its start and end, since other
processes on a small machine move every number; `engine_threads` says whether the engine was called from the
main thread or a worker (DuckDB's, Polars') thread, `machine.torch_threads` how many intra-op threads torch had.
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (ROOT, RESULTS_DIR, Timer, append_jsonl, base_record, command_line, cuda_available,  # noqa: E402
                          device_slug, git_commit, new_run_id, package_versions, peak_gib, read_jsonl, reset_peak,
                          rewrite_jsonl, rows_per_hour, size_gib, write_text_atomic)

PATHS = ("engine", "pipeline", "polars", "polars-streaming", "duckdb-relation", "duckdb-udf")
PIPELINE = ROOT / "pipelines" / "bench_invoices.yaml"
UDF_NAME = "extract_invoice"
OUTPUT = "fields"
VERSIONS = ("torch", "transformers", "tokenizers", "polars", "polars-runtime-32", "duckdb", "pyarrow", "llguidance",
            "pydantic", "click")


# ---- data
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


# ---- observing the engine
class StreamProbe:
    """Wraps `llm.stream` on the instance: counts calls, groups, rows and generated tokens, notes when the first
    group arrived and which plan each call used. `reset()` per path; `undo()` restores the method."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._orig = llm.stream
        llm.stream = self.stream
        self.reset()

    def reset(self) -> None:
        self.calls = self.groups = self.rows = self.tokens = 0
        self.first: float | None = None
        self.plans: list[dict[str, Any]] = []
        self.threads: set[str] = set()

    def stream(self, prompts: Any, params: Any = None, **kwargs: Any):
        self.calls += 1
        self.threads.add("main" if threading.current_thread() is threading.main_thread() else "worker")
        for group in self._orig(prompts, params, **kwargs):
            if self.first is None:
                self.first = time.perf_counter()
            self.groups += 1
            self.rows += len(group)
            self.tokens += sum(len(c.token_ids) for _, c in group)
            yield group
        self._note_plan()

    def _note_plan(self) -> None:
        plan = getattr(self.llm, "last_plan", None)
        if plan is not None and hasattr(plan, "to_dict"):
            entry = plan.to_dict()
        else:
            policy = getattr(self.llm, "policy", None)
            entry = {"policy": policy.to_dict() if hasattr(policy, "to_dict") else str(policy)}
        key = json.dumps(entry, sort_keys=True, default=str)
        for seen in self.plans:
            if seen["key"] == key:
                seen["calls"] += 1
                return
        self.plans.append({"key": key, "calls": 1, **entry})

    def plans_out(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in p.items() if k != "key"} for p in self.plans]

    def undo(self) -> None:
        self.llm.stream = self._orig


def _non_null(values: list[Any]) -> int:
    return sum(v is not None for v in values)


# ---- the paths. Each returns {"seconds", "first_result_s", "first_result_note", "non_null_rows", ...}.
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
        os.environ["LLMOPS_BENCH_INPUT"] = str(self.csv)
        os.environ["LLMOPS_BENCH_OUTPUT"] = str(sink)
        overrides = [f"steps.0.llm_map.max_new_tokens={self.spec.max_new_tokens}",
                     *(f"engine.{k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in self.settings.items())]
        argv = ["run", str(self.args.pipeline), "--no-cache", "--json", "--allow-errors", "--no-progress",
                "--model", self.model, *(x for o in overrides for x in ("--set", o))]
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


def _loadavg() -> float | None:
    """The 1-minute load average (other processes on a small machine move every number)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _stats_snapshot(llm: Any) -> Any:
    """A snapshot of the engine's `EngineStats` (None for an engine without them)."""
    stats = getattr(llm, "stats", None)
    return stats.snapshot() if hasattr(stats, "snapshot") else None


def _stats_since(llm: Any, before: Any) -> dict[str, Any] | None:
    """The engine's counters since `before` (`_stats_snapshot`): blocks, prefilled_ahead, steps, tokens and
    seconds; None without stats."""
    stats = getattr(llm, "stats", None)
    if before is None or not hasattr(stats, "since"):
        return None
    d = stats.since(before).to_dict()
    keep = ("blocks", "prefilled_ahead", "steps", "generated_tokens", "plan_s", "place_s", "prefill_s", "decode_s",
            "grammar_mask_s", "callback_s")
    return {k: (round(d[k], 3) if isinstance(d[k], float) else d[k]) for k in keep if k in d}


def _plans_ahead(plans: list[dict[str, Any]]) -> bool | list[bool] | None:
    """Whether the path's plan(s) had `Policy.prefill_ahead`: one flag, or one per plan when they differ."""
    flags = [bool((p.get("policy") or {}).get("prefill_ahead")) for p in plans if isinstance(p.get("policy"), dict)]
    if not flags:
        return None
    return flags[0] if len(set(flags)) == 1 else flags


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def model_info(llm: Any, model: str) -> dict[str, Any]:
    c = llm.config
    info: dict[str, Any] = {"name": Path(model).name if os.path.sep in model else model, "path": model,
                            "architecture": c.architecture, "hidden_size": c.hidden_size,
                            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
                            "num_key_value_heads": c.num_key_value_heads, "intermediate_size": c.intermediate_size,
                            "vocab_size": c.vocab_size, "tie_word_embeddings": c.tie_word_embeddings,
                            "dtype": str(llm.dtype).removeprefix("torch."), "fingerprint": getattr(llm, "fingerprint", None),
                            "num_local_experts": getattr(c, "num_local_experts", None),
                            "int4": c.quantization_config.tag if getattr(c, "quantization_config", None) else None}
    try:
        specs = llm.loaded.family.layer_specs()
        info["params"] = sum({ws.sources: ws.numel for s in specs for ws in s.weights.values()}.values())
    except Exception:  # noqa: BLE001 (informative only)
        info["params"] = None
    bench = Path(model) / "bench_model.json"
    if bench.is_file():
        meta = json.loads(bench.read_text())
        info.update(shape=meta.get("shape"), random_weights=True, seed=meta.get("seed"))
    else:
        info["random_weights"] = False
    return info


def prompt_token_counts(llm: Any, prompts: list[Any], params: Any) -> list[int] | None:
    """Prompt lengths as the engine encodes them (chat template applied); None when that API is not there."""
    try:
        from engine.decoding.prompts import encode_prompts

        enc = encode_prompts(prompts, params, llm.tokenizer, llm.config.vocab_size, llm.max_context)
        return [len(e.ids) for e in enc]
    except Exception:  # noqa: BLE001
        return None


def warm_up(job: Job, rows: int | None, new_tokens: int, cap: int) -> dict[str, Any]:
    """Plan the job's workload once (LLM.plan over every prompt, when the engine has it), then generate
    `new_tokens` for `rows` other rows with that plan (None: one block of the plan's policy, at most `cap`
    rows), so the executor, its batch buffers and the grammar machinery exist before any path is timed."""
    from dataclasses import replace

    from llmops.templates import render_rows

    llm = job.llm
    info: dict[str, Any] = {}
    with Timer() as t:
        plan = None
        if hasattr(llm, "plan"):
            plan = llm.plan(job.prompts, job.params)
            info["plan"] = plan.to_dict() if hasattr(plan, "to_dict") else str(plan)
            info["plan_s"] = round(t.elapsed, 3)
        if rows is None:
            block = getattr(getattr(plan, "policy", None), "block_size", None)
            rows = min(int(block), cap) if block else 16
        rows = min(rows, len(job.rows))
        info.update(rows=rows, new_tokens=new_tokens)
        if rows:
            bodies = [r["body"] for r in invoice_rows(rows, offset=len(job.rows))]
            prompts = [o.prompt for o in render_rows(job.spec.template, {"body": bodies}, rows,
                                                     system=job.spec.system, examples=job.spec.examples)]
            params = replace(job.params, max_new_tokens=min(new_tokens, job.params.max_new_tokens))
            kwargs = {"plan": plan} if plan is not None else {}
            for _ in llm.stream(prompts, params, **kwargs):
                pass
    info["seconds"] = round(t.seconds, 3)
    return info


def main() -> None:
    cuda = cuda_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {','.join(PATHS)}")
    ap.add_argument("--rows", type=int, default=10_000 if cuda else 64, help="rows per path (GPU 10000, CPU 64)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="alias, preset or HF folder")
    ap.add_argument("--gpu-memory", default="16GiB" if cuda else None,
                    help="engine gpu_memory budget (default 16GiB with a GPU, none without; 'none' for none)")
    ap.add_argument("--policy", default="auto",
                    help='engine.policy of every path: "auto" (the job is planned once) or a Policy as JSON')
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--device", default="auto", help="engine device (auto|cpu|cuda)")
    ap.add_argument("--dtype", default="auto", help="engine dtype (auto|bfloat16|float16|float32)")
    ap.add_argument("--warmup-rows", type=int, default=None,
                    help="rows of the untimed warm-up (default: one block of the job's plan, at most "
                         "--warmup-cap; 0: plan only)")
    ap.add_argument("--warmup-cap", type=int, default=1024 if cuda else 128)
    ap.add_argument("--warmup-new-tokens", type=int, default=8, help="new tokens per warm-up row")
    ap.add_argument("--run-id", default=None, help="shared by this invocation's records (default: generated)")
    ap.add_argument("--commit", default=None, help="commit to record when there is no .git (or $LLMOPS_COMMIT)")
    ap.add_argument("--pipeline", type=Path, default=PIPELINE, help="pipeline YAML with one llm_map step")
    ap.add_argument("--polars-streaming", choices=("sink_batches", "sink_parquet", "collect"), default="sink_batches")
    ap.add_argument("--duckdb-fetch", choices=("reader", "arrow", "fetchall"), default="reader")
    ap.add_argument("--unordered", action="store_true",
                    help="let results arrive out of order: Polars sinks with maintain_order=False, DuckDB with "
                         "preserve_insertion_order=false (both hold results back until earlier ones are done "
                         "otherwise)")
    ap.add_argument("--duckdb-batch", type=int, default=2048, help="rows per Arrow batch read from DuckDB")
    ap.add_argument("--work-dir", default=None, help="folder for the input and output files (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSONL file the records are appended to (default benchmarks/results/job_paths_<device>.jsonl)")
    ap.add_argument("--fresh", action="store_true", help="empty --out first instead of appending")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads(N) first (default: torch's own choice). On a shared CPU, 1 keeps "
                         "paths comparable: with 2 threads on 2 busy cores, calls from the main thread (engine, "
                         "pipeline) ran small ops up to 7x slower than calls from DuckDB's/Polars' threads")
    ap.add_argument("--interleave", action="store_true",
                    help="run the engine path before and after every other path (for noisy machines): "
                         "ratio_to_engine is against the engine run just before, ratio_to_engine_bracketed "
                         "against the mean of the runs before and after")
    ap.add_argument("--engine-again", action="store_true",
                    help="run the engine path once more at the end (repeat 2: shows drift over the run)")
    args = ap.parse_args()

    import yaml

    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        ap.error(f"unknown path(s) {unknown}; choose from {','.join(PATHS)}")
    paths = (["engine"] if "engine" in paths else []) + [p for p in dict.fromkeys(paths) if p != "engine"]
    gpu_memory = None if args.gpu_memory in (None, "", "none", "None") else args.gpu_memory
    # settings as a pipeline's `--set engine.K=V` reads them (YAML scalars) so every path keys the same engine
    settings: dict[str, Any] = {}
    if gpu_memory is not None:
        settings["gpu_memory"] = yaml.safe_load(str(gpu_memory))
    if args.policy != "auto":
        settings["policy"] = json.loads(args.policy)
    if args.device != "auto":
        settings["device"] = args.device
    if args.dtype != "auto":
        settings["dtype"] = args.dtype
    args.model_ref = str(Path(args.model).resolve()) if Path(args.model).is_dir() else args.model
    out = args.out or RESULTS_DIR / f"job_paths_{device_slug()}.jsonl"
    if args.fresh:
        write_text_atomic(out, "")
    run_id = args.run_id or new_run_id()
    commit = git_commit(args.commit)
    command = command_line()

    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    from llmops import engines
    from llmops.core import get_engine, last_summary

    job = Job(args, load_step(args.pipeline), settings)
    with Timer() as t_load:
        job.llm = get_engine(job.spec)
    probe = job.probe = StreamProbe(job.llm)
    counts = prompt_token_counts(job.llm, job.prompts, job.params)
    warm = warm_up(job, args.warmup_rows, args.warmup_new_tokens, args.warmup_cap)
    probe.reset()
    print(f"[job_paths] run {run_id}: {args.rows} rows, model {args.model_ref}, settings {settings}, "
          f"load {t_load.seconds:.1f}s, warm-up {warm['seconds']:.1f}s -> {out}", file=sys.stderr)

    step = job.step
    workload = {
        "rows": args.rows, "distinct_prompts": len({json.dumps(p) for p in job.prompts}),
        "prompt_tokens_mean": round(sum(counts) / len(counts), 1) if counts else None,
        "prompt_tokens_min": min(counts) if counts else None, "prompt_tokens_max": max(counts) if counts else None,
        "max_new_tokens": args.max_new_tokens, "template": step["template"][:120],
        "schema": {k: v for k, v in (step.get("schema") or {}).items()}, "examples": len(step.get("examples") or ()),
        "system": bool(step.get("system")), "source": "sample_data/invoices.csv bodies, invoice numbers redrawn",
        "description": "invoice email -> JSON {invoice_number, total_amount, currency}, constrained decoding, "
                       f"{len(step.get('examples') or ())} few-shot turns, chat template",
    }
    common = {**base_record(run_id, "llmops", commit=commit, command=command), "rows": args.rows,
              "workload": workload, "model": model_info(job.llm, args.model_ref),
              "gpu_memory_gib": size_gib(gpu_memory), "engine_settings": settings, "warmup_s": warm["seconds"],
              "warmup": warm, "load_s": round(t_load.seconds, 3),
              "versions": package_versions(VERSIONS)}
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "engine": job.run_engine, "pipeline": job.run_pipeline, "polars": job.run_polars,
        "polars-streaming": job.run_polars_streaming, "duckdb-relation": job.run_duckdb_relation,
        "duckdb-udf": job.run_duckdb_udf}
    previous_engine_rate: float | None = None
    engine_rate = next((r.get("rows_per_h") for r in read_jsonl(out)
                        if r.get("run_id") == run_id and r.get("path") == "engine" and r.get("rows_per_h")), None)
    first_engine_rate = engine_rate
    done: list[dict[str, Any]] = []
    others = [p for p in paths if p != "engine"]
    if args.interleave and "engine" in paths:
        order = ["engine"] + [x for p in others for x in (p, "engine")]
    else:
        order = paths + (["engine"] if args.engine_again and "engine" in paths else [])
    pending_bracket: dict[str, Any] | None = None   # the operator record waiting for the engine run after it
    try:
        for n_path, path in enumerate(order):
            gc.collect()
            probe.reset()
            reset_peak()
            load_start = _loadavg()
            summary_before = last_summary()
            stats_before = _stats_snapshot(job.llm)
            start = time.perf_counter()
            record: dict[str, Any] = {**common, "path": path, "order": n_path,
                                      "repeat": order[:n_path].count(path) + 1}
            try:
                res = runners[path]()
            except Exception as exc:  # noqa: BLE001 (one path failing must not lose the others)
                res = {"seconds": None, "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()[-3000:]}
            res.update(peak_gib())
            seconds = res.get("seconds")
            rate = rows_per_hour(args.rows, seconds)
            if path == "engine" and rate and (engine_rate is None or args.interleave):
                previous_engine_rate, engine_rate = engine_rate, rate
            base_rate = (first_engine_rate or engine_rate) if path == "engine" else engine_rate
            if path == "engine" and first_engine_rate is None:
                first_engine_rate = engine_rate
            summary = last_summary()
            summary = None if path == "engine" or summary is summary_before else summary
            record.update(
                seconds=round(seconds, 3) if seconds else None, rows_per_h=rate,
                tokens_per_s=round(probe.tokens / seconds, 2) if seconds else None,
                ratio_to_engine=round(rate / base_rate, 4) if rate and base_rate else None,
                generated_tokens=probe.tokens, engine_calls=probe.calls, engine_groups=probe.groups,
                engine_rows=probe.rows,
                engine_first_block_s=round(probe.first - start, 3) if probe.first is not None else None,
                plans=probe.plans_out(), prefill_ahead=_plans_ahead(probe.plans_out()),
                engine_stats=_stats_since(job.llm, stats_before), engine_threads=sorted(probe.threads),
                engines_cached=len(getattr(engines, "_ENGINES", {})),
                loadavg_start=load_start, loadavg_end=_loadavg(),
                last_map_summary=summary.to_dict() if summary is not None else None,
                **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items() if k != "seconds"})
            if record["engines_cached"] > 1:
                record["warning"] = "more than one engine was built: the settings of some path differ"
            append_jsonl(out, record)
            done.append(record)
            if args.interleave:
                if path != "engine":
                    pending_bracket = record
                elif pending_bracket is not None and rate and previous_engine_rate:
                    mean = (previous_engine_rate + rate) / 2
                    pending_bracket["ratio_to_engine_bracketed"] = round(pending_bracket["rows_per_h"] / mean, 4) \
                        if pending_bracket.get("rows_per_h") else None
                    pending_bracket["engine_rows_per_h_bracket"] = [previous_engine_rate, rate]
                    rewrite_jsonl(out, pending_bracket, ("run_id", "order"))
                    pending_bracket = None
            print(f"[job_paths] {path:17s} " + (f"{seconds:8.2f}s {rate:10.0f} rows/h  first "
                  f"{record.get('first_result_s')}  ratio {record['ratio_to_engine']}  non-null "
                  f"{record.get('non_null_rows')}/{args.rows}  tokens {probe.tokens}  peak {record['peak_device_gib']}  "
                  f"ahead {record['prefill_ahead']}/{(record['engine_stats'] or {}).get('prefilled_ahead')} of "
                  f"{(record['engine_stats'] or {}).get('blocks')} blocks"
                  if seconds else f"FAILED {record['error']}"), file=sys.stderr)
    finally:
        probe.undo()
        if not args.work_dir:
            shutil.rmtree(job.work, ignore_errors=True)
    print(json.dumps([{k: r.get(k) for k in ("path", "repeat", "seconds", "rows_per_h", "first_result_s", "ratio_to_engine",
                                             "ratio_to_engine_bracketed", "non_null_rows", "generated_tokens",
                                             "peak_device_gib", "prefill_ahead", "error")}
                      | {"prefilled_ahead": (r.get("engine_stats") or {}).get("prefilled_ahead"),
                         "blocks": (r.get("engine_stats") or {}).get("blocks")}
                      for r in done], indent=1))


if __name__ == "__main__":
    main()
