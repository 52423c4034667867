"""Every product path against the engine directly: the same N invoice rows, the same prompts, one process.

    python benchmarks/operators/job_paths.py --model .bench_assets/tiny_model --rows 64 --max-new-tokens 16 \
        --paths engine,pipeline,polars,polars-streaming,duckdb-relation,duckdb-udf --out /tmp/job_paths.jsonl
    python benchmarks/operators/job_paths.py --model smollm2-135m-instruct --rows 200 --interleave \
        --torch-threads 1                                                 # the CPU comparison
    # GPU (defaults there: 10,000 rows, --gpu-memory 16GiB), a random-weight model from models/build_bench_model.py:
    python benchmarks/operators/job_paths.py --model /tmp/llama_1b --interleave --unordered \
        --paths engine,polars,polars-streaming,duckdb-relation,duckdb-udf,pipeline

Paths (each one job over all N rows, result cache off everywhere):
- engine: `LLM.stream(prompts, params)` on the engine the operator layer caches for these settings, with the
  prompts llmops itself renders (`llmops.templates.render_rows` + `llmops.core.sampling_params` of the MapSpec
  built from the pipeline file's llm_map step: same chat messages, few-shot turns and json_schema);
- pipeline: `llmops run pipelines/bench_invoices.yaml --no-cache --json --allow-errors` in-process (click's
  CliRunner, so the same cached engine serves it and torch's peak can be read), CSV source of the N rows,
  parquet sink;
- pipeline-dry: `llmops run --dry-run` in a fresh process: `run_plans` holds the plan it shows;
- pipeline-cold: the same `llmops run` in a fresh process, timed end to end (model load, planning, warm-up and
  the run: what a user's command pays; its device peak is the other process's, recorded null; the modules it
  imports are byte-compiled before any fresh process starts, as an installed package's are; this process's
  engine is closed and its device and pinned host memory given back first, and built again, untimed, before
  an in-process path that follows; `process_split_s` splits its wall time: outside the pipeline's own clock
  until its summary prints (start-up, imports, the run report), the pipeline, after the summary (teardown));
- pipeline-first: pipeline-cold with the plan cache emptied first, so the run plans the job itself (the first
  run of a job on a machine whose hardware profile is cached); put it before pipeline-cold, which then reads
  the plan it cached;
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

Output: one record per path, appended to benchmarks/records/<machine>/job_paths.jsonl (or --out; `--fresh`
empties --out first) as soon as the path finishes, so a run killed part-way keeps the finished paths. Fields:
run_id (shared by the records of one invocation), benchmark "job_paths", workload (`--workload`, default
"invoices"; `workload_detail`: rows, prompt tokens, schema, few-shot turns), path,
system "llmops", rows, seconds, rows_per_h, tokens_per_s, first_result_s (+ first_result_note), ratio_to_engine
(rows_per_h over the engine record's of the same run_id; with `--interleave` the engine runs before and
after every path, ratio_to_engine is against the one just before and ratio_to_engine_bracketed against the
mean of both, rewritten into the file atomically), peak_device_gib / peak_reserved_gib (torch's peaks
since the path started; null on CPU), gpu_memory_gib, device, machine, commit, command, model (its name;
`model_detail`: its shape, with num_local_experts and int4: the checkpoint's AWQ/GPTQ tag, e.g. awq-g128, null
for float weights),
non_null_rows (rows whose output struct is non-null), generated_tokens, engine_calls, engine_first_block_s
(when the engine finished its first block, seen from inside), plans (the engine's plan(s) used),
prefill_ahead (whether the plan(s) of the path's engine calls had `Policy.prefill_ahead`: true / false, or
the list of flags per plan when they differ; null when no plan was seen), engine_stats (the engine's
`EngineStats` over the path, `stats.since` a snapshot taken at its start: blocks, prefilled_ahead (blocks
whose prefill ran on the previous block's decode), steps, generated_tokens, plan_s, place_s, prefill_s,
decode_s, grammar_mask_s, grammar_advance_s (its part feeding tokens to the grammar), callback_s; null for an
engine without `stats`), warmup_s, load_s, engines_cached,
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
import gc
import json
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import (Timer, append_jsonl, base_record, close_and_release, command_line,  # noqa: E402
                               cuda_available, git_commit, new_run_id, package_versions, peak_gib, read_jsonl,
                               record_path, reset_peak, rewrite_jsonl, rows_per_hour, size_gib, write_text_atomic)
from benchmarks.operators.engine_probe import (StreamProbe, loadavg, model_info, plans_ahead,  # noqa: E402
                                               prompt_token_counts, stats_since, stats_snapshot)
from benchmarks.operators.invoice_job import PATHS, PIPELINE, Job, invoice_rows, load_step  # noqa: E402

VERSIONS = ("torch", "transformers", "tokenizers", "polars", "polars-runtime-32", "duckdb", "pyarrow", "llguidance",
            "pydantic", "click")
SUMMARY_FIELDS = ("path", "repeat", "seconds", "rows_per_h", "first_result_s", "ratio_to_engine",
                  "ratio_to_engine_bracketed", "non_null_rows", "generated_tokens", "peak_device_gib", "prefill_ahead",
                  "error")


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


def build_parser(cuda: bool) -> argparse.ArgumentParser:
    """The harness's options; GPU defaults where `cuda`."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {','.join(PATHS)}")
    ap.add_argument("--rows", type=int, default=10_000 if cuda else 64, help="rows per path (GPU 10000, CPU 64)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="alias, preset or HF folder")
    ap.add_argument("--workload", default="invoices", help="the records' workload name")
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
                    help="JSONL file the records are appended to (default benchmarks/records/<machine>/job_paths.jsonl)")
    ap.add_argument("--fresh", action="store_true", help="empty --out first instead of appending (needs --out)")
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
    return ap


def chosen_paths(ap: argparse.ArgumentParser, text: str) -> list[str]:
    """The --paths asked for, `engine` first, each once; an unknown name is an argparse error naming it."""
    paths = [p.strip() for p in text.split(",") if p.strip()]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        ap.error(f"unknown path(s) {unknown}; choose from {','.join(PATHS)}")
    return (["engine"] if "engine" in paths else []) + [p for p in dict.fromkeys(paths) if p != "engine"]


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings every path uses, as a pipeline's `--set engine.K=V` reads them (YAML scalars), so
    every path keys the same cached engine."""
    import yaml

    settings: dict[str, Any] = {}
    if args.gpu_memory is not None:
        settings["gpu_memory"] = yaml.safe_load(str(args.gpu_memory))
    if args.policy != "auto":
        settings["policy"] = json.loads(args.policy)
    if args.device != "auto":
        settings["device"] = args.device
    if args.dtype != "auto":
        settings["dtype"] = args.dtype
    return settings


def path_order(paths: list[str], interleave: bool, engine_again: bool) -> list[str]:
    """The runs in order: with `interleave`, the engine before and after every other path; else each path once
    (and the engine again at the end with `engine_again`)."""
    others = [p for p in paths if p != "engine"]
    if interleave and "engine" in paths:
        return ["engine"] + [x for p in others for x in (p, "engine")]
    return paths + (["engine"] if engine_again and "engine" in paths else [])


def workload_detail(job: Job, counts: list[int] | None, max_new_tokens: int) -> dict[str, Any]:
    """What the rows and prompts are: rows, distinct prompts, prompt tokens, schema, few-shot turns."""
    step = job.step
    return {
        "rows": len(job.rows), "distinct_prompts": len({json.dumps(p) for p in job.prompts}),
        "prompt_tokens_mean": round(sum(counts) / len(counts), 1) if counts else None,
        "prompt_tokens_min": min(counts) if counts else None, "prompt_tokens_max": max(counts) if counts else None,
        "max_new_tokens": max_new_tokens, "template": step["template"][:120],
        "schema": {k: v for k, v in (step.get("schema") or {}).items()}, "examples": len(step.get("examples") or ()),
        "system": bool(step.get("system")), "source": "sample_data/invoices.csv bodies, invoice numbers redrawn",
        "description": "invoice email -> JSON {invoice_number, total_amount, currency}, constrained decoding, "
                       f"{len(step.get('examples') or ())} few-shot turns, chat template",
    }


class EngineRates:
    """The engine's rows/h that each path's ratio is taken against: the first engine run of the invocation
    (or the file's earlier engine record of the same run id), the latest, and the one before it (the pair an
    interleaved path sits between)."""

    def __init__(self, first: float | None, interleave: bool) -> None:
        self.first = self.latest = first
        self.previous: float | None = None
        self.interleave = interleave

    def base_for(self, path: str, rate: float | None) -> float | None:
        """Note an engine run's `rate`, then the rate `path`'s ratio is against."""
        if path == "engine" and rate and (self.latest is None or self.interleave):
            self.previous, self.latest = self.latest, rate
        base = (self.first or self.latest) if path == "engine" else self.latest
        if path == "engine" and self.first is None:
            self.first = self.latest
        return base


def run_path(job: Job, path: str, runner: Callable[[], dict[str, Any]], common: dict[str, Any], order: int,
             repeat: int, rates: EngineRates) -> dict[str, Any]:
    """One timed run of `path`: the runner's result (or its error: one path failing must not lose the others),
    the rate and its ratio to the engine, and what the probe and the engine's counters saw."""
    from llmops import engines
    from llmops.core import last_summary

    probe = job.probe
    gc.collect()
    probe.reset()
    reset_peak()
    load_start = loadavg()
    summary_before = last_summary()
    stats_before = stats_snapshot(job.llm)
    start = time.perf_counter()
    record: dict[str, Any] = {**common, "path": path, "order": order, "repeat": repeat}
    try:
        res = runner()
    except Exception as exc:  # noqa: BLE001 (one path failing must not lose the others)
        res = {"seconds": None, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    res = {**peak_gib(), **res}          # a runner in another process says its peak is not this one's
    seconds = res.get("seconds")
    rate = rows_per_hour(len(job.rows), seconds)
    base_rate = rates.base_for(path, rate)
    summary = last_summary()
    summary = None if path == "engine" or summary is summary_before else summary
    record.update(
        seconds=round(seconds, 3) if seconds else None, rows_per_h=rate,
        tokens_per_s=round(probe.tokens / seconds, 2) if seconds else None,
        ratio_to_engine=round(rate / base_rate, 4) if rate and base_rate else None,
        generated_tokens=probe.tokens, engine_calls=probe.calls, engine_groups=probe.groups,
        engine_rows=probe.rows,
        engine_first_block_s=round(probe.first - start, 3) if probe.first is not None else None,
        plans=probe.plans_out(), prefill_ahead=plans_ahead(probe.plans_out()),
        engine_stats=stats_since(job.llm, stats_before), engine_threads=sorted(probe.threads),
        engines_cached=len(getattr(engines, "_ENGINES", {})),
        loadavg_start=load_start, loadavg_end=loadavg(),
        last_map_summary=summary.to_dict() if summary is not None else None,
        **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items() if k != "seconds"})
    if record["engines_cached"] > 1:
        record["warning"] = "more than one engine was built: the settings of some path differ"
    return record


def print_progress(record: dict[str, Any], rows: int) -> None:
    """One line per finished path on stderr."""
    stats = record["engine_stats"] or {}
    seconds = record.get("seconds")
    text = (f"{seconds:8.2f}s {record['rows_per_h']:10.0f} rows/h  first {record.get('first_result_s')}  ratio "
            f"{record['ratio_to_engine']}  non-null {record.get('non_null_rows')}/{rows}  tokens "
            f"{record['generated_tokens']}  peak {record['peak_device_gib']}  ahead {record['prefill_ahead']}/"
            f"{stats.get('prefilled_ahead')} of {stats.get('blocks')} blocks" if seconds else
            f"FAILED {record['error']}")
    print(f"[job_paths] {record['path']:17s} {text}", file=sys.stderr)


FRESH = ("pipeline-dry", "pipeline-first", "pipeline-cold")   # each runs `llmops` in a process of its own


def run_all(job: Job, order: list[str], common: dict[str, Any], out: Path, interleave: bool,
            rewarm: Callable[[], Any]) -> list[dict[str, Any]]:
    """Every run of `order`, each record appended to `out` as it finishes; with `interleave`, a path's record is
    rewritten with its ratio to the mean of the engine runs around it (`ratio_to_engine_bracketed`) once the
    engine run after it has finished. Before a FRESH path this process's engine is closed and its device and
    pinned host memory given back (a user's command does not share the machine with a resident engine); before
    the next in-process path `rewarm()` builds it again, untimed."""
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "engine": job.run_engine, "pipeline": job.run_pipeline, "pipeline-dry": job.run_pipeline_dry,
        "pipeline-first": job.run_pipeline_first, "pipeline-cold": job.run_pipeline_cold,
        "polars": job.run_polars,
        "polars-streaming": job.run_polars_streaming, "duckdb-relation": job.run_duckdb_relation,
        "duckdb-udf": job.run_duckdb_udf}
    first = next((r.get("rows_per_h") for r in read_jsonl(out)
                  if r.get("run_id") == common["run_id"] and r.get("path") == "engine" and r.get("rows_per_h")), None)
    rates = EngineRates(first, interleave)
    done: list[dict[str, Any]] = []
    pending: dict[str, Any] | None = None   # the operator record waiting for the engine run after it
    released = False
    for n, path in enumerate(order):
        if path in FRESH and not released:
            close_and_release(job.llm)
            released = True
        elif path not in FRESH and released:
            rewarm()
            released = False
        record = run_path(job, path, runners[path], common, n, order[:n].count(path) + 1, rates)
        append_jsonl(out, record)
        done.append(record)
        if interleave:
            if path != "engine":
                pending = record
            elif pending is not None and record["rows_per_h"] and rates.previous:
                mean = (rates.previous + record["rows_per_h"]) / 2
                pending["ratio_to_engine_bracketed"] = round(pending["rows_per_h"] / mean, 4) \
                    if pending.get("rows_per_h") else None
                pending["engine_rows_per_h_bracket"] = [rates.previous, record["rows_per_h"]]
                rewrite_jsonl(out, pending, ("run_id", "order"))
                pending = None
        print_progress(record, len(job.rows))
    return done


def main() -> None:
    cuda = cuda_available()
    ap = build_parser(cuda)
    args = ap.parse_args()
    paths = chosen_paths(ap, args.paths)
    args.gpu_memory = None if args.gpu_memory in (None, "", "none", "None") else args.gpu_memory
    settings = engine_settings(args)
    args.model_ref = str(Path(args.model).resolve()) if Path(args.model).is_dir() else args.model
    if args.fresh and args.out is None:
        ap.error("--fresh empties the file --out names; without --out it would empty the machine's records")
    out = args.out or record_path("job_paths")
    if args.fresh:
        write_text_atomic(out, "")
    run_id = args.run_id or new_run_id()
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    from llmops.core import get_engine

    job = Job(args, load_step(args.pipeline), settings)
    with Timer() as t_load:
        job.llm = get_engine(job.spec)
    job.probe = StreamProbe(job.llm)
    counts = prompt_token_counts(job.llm, job.prompts, job.params)
    warm = warm_up(job, args.warmup_rows, args.warmup_new_tokens, args.warmup_cap)
    job.probe.reset()
    print(f"[job_paths] run {run_id}: {args.rows} rows, model {args.model_ref}, settings {settings}, "
          f"load {t_load.seconds:.1f}s, warm-up {warm['seconds']:.1f}s -> {out}", file=sys.stderr)
    model = model_info(job.llm, args.model_ref)
    common = {**base_record(run_id, "llmops", commit=git_commit(args.commit), command=command_line()),
              "benchmark": "job_paths", "workload": args.workload, "model": model["name"],
              "gpu_memory_gib": size_gib(args.gpu_memory), "rows": args.rows,
              "workload_detail": workload_detail(job, counts, args.max_new_tokens), "model_detail": model,
              "engine_settings": settings, "warmup_s": warm["seconds"], "warmup": warm,
              "load_s": round(t_load.seconds, 3), "versions": package_versions(VERSIONS)}
    try:
        done = run_all(job, path_order(paths, args.interleave, args.engine_again), common, out, args.interleave,
                       lambda: warm_up(job, args.warmup_rows, args.warmup_new_tokens, args.warmup_cap))
    finally:
        job.probe.undo()
        if not args.work_dir:
            shutil.rmtree(job.work, ignore_errors=True)
    print(json.dumps([{k: r.get(k) for k in SUMMARY_FIELDS}
                      | {"prefilled_ahead": (r.get("engine_stats") or {}).get("prefilled_ahead"),
                         "blocks": (r.get("engine_stats") or {}).get("blocks")}
                      for r in done], indent=1))


if __name__ == "__main__":
    main()
