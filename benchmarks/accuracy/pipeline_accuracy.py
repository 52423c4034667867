"""Accuracy of each sample pipeline against the label columns of its sample table.

Runs every `pipelines/*.yaml` task on its first N rows (the pipeline as written: model, prompts, few-shot
examples; only the sink is redirected to a temporary folder) and compares each predicted column with its
label. `--cascade small,large --min-confidence X` runs each task's llm_map step as that cascade instead
(`llmops.cascade`). Every run also keeps each row's confidence and answering model (the step's
`confidence_column` / `model_column`, carried through the SQL steps after it by joining on `id`), so a task
reports how accurate its confident rows are against the rest. Appends one record to
benchmarks/records/<machine>/pipeline_accuracy.jsonl (or --out): the common fields (tokens_per_s over all
tasks) and {"rows", "overrides", "cascade", "min_confidence", "tasks": {task: {"rows", "seconds",
"generated_tokens", "tokens_per_s", "failed_rows", "model", "seconds_by_model": {model: seconds}, "valid_rate",
"row_accuracy", "mean_field_accuracy", "fields": {column: accuracy}, "rows_per_model": {model: rows}, "calibration":
{"threshold", "confident": {"rows", "mean_field_accuracy"}, "unsure": {...}, "unknown_rows", "bins": [{"from",
"rows", "mean_field_accuracy"}]}}}}.

Usage (from the repository root):
    python benchmarks/accuracy/pipeline_accuracy.py --rows 20
    python benchmarks/accuracy/pipeline_accuracy.py --rows 20 --model qwen2.5-0.5b-instruct
    python benchmarks/accuracy/pipeline_accuracy.py --rows 20 --cascade smollm2-135m-instruct,qwen2.5-0.5b-instruct \
        --min-confidence 0.9
    python benchmarks/accuracy/pipeline_accuracy.py --rows 2 --tasks classify_tickets --no-cache --out /tmp/p.jsonl
    python benchmarks/accuracy/pipeline_accuracy.py --rows 200 --tasks classify_tickets --set model=/models/Llama-3-8B-Instruct
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import duckdb

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import ROOT as REPO, add_record_args, new_record, save_record  # noqa: E402
from llmops.pipeline.load import load_pipeline  # noqa: E402
from llmops.pipeline.runner import run_pipeline  # noqa: E402


def _text(value: Any) -> str | None:
    return None if value is None else str(value).strip()


def same_text(pred: Any, label: Any) -> bool:
    return _text(pred) is not None and _text(pred) == _text(label)


def same_label(pred: Any, label: Any) -> bool:
    return _text(pred) is not None and _text(pred).lower() == _text(label).lower()


def close_number(tolerance: float) -> Callable[[Any, Any], bool]:
    def compare(pred: Any, label: Any) -> bool:
        try:
            return pred is not None and abs(float(pred) - float(label)) <= tolerance
        except (TypeError, ValueError):
            return False
    return compare


def same_date(pred: Any, label: Any) -> bool:
    iso = lambda v: v.isoformat() if isinstance(v, (dt.date, dt.datetime)) else _text(v)  # noqa: E731
    return pred is not None and iso(pred) == iso(label)


BENCHMARK, WORKLOAD = "pipeline_accuracy", "sample-pipelines"
# task -> (source CSV, {predicted column: (label column, comparison)})
TASKS: dict[str, tuple[str, dict[str, tuple[str, Callable[[Any, Any], bool]]]]] = {
    "extract_invoices": ("sample_data/invoices.csv", {
        "invoice_number": ("label_invoice_number", same_text),
        "total_amount": ("label_total_amount", close_number(0.005)),
        "currency": ("label_currency", same_label),
        "due_date": ("label_due_date", same_date),
    }),
    "clean_customers": ("sample_data/customers_messy.csv", {
        "clean_name": ("label_name", same_text),
        "clean_city": ("label_city", same_text),
        "clean_signup_date": ("label_signup_date", same_date),
        "clean_phone": ("label_phone", same_text),
        "clean_weight_kg": ("label_weight_kg", close_number(0.15)),
    }),
    "match_products": ("sample_data/products_pairs.csv", {"decision": ("label", same_label)}),
    "classify_tickets": ("sample_data/tickets.csv", {"category": ("label", same_label)}),
}


def _rows(sql: str, params: dict | None = None) -> list[dict]:
    con = duckdb.connect()
    try:
        return con.sql(sql, params=params).to_arrow_table().to_pylist()
    finally:
        con.close()


CONFIDENCE, ANSWERED_BY = "_confidence", "_model"   # the meta columns each task's llm_map step writes
THRESHOLD = 0.9   # the calibration split: rows at or above it against rows below
BINS = 10         # and the mean field accuracy of the rows in each tenth of the confidence range


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def score(task: str, predicted: list[dict]) -> dict[str, Any]:
    """Per-field accuracy, all-fields row accuracy, the share of rows with every field non-null, rows per
    answering model, and the mean field accuracy of rows whose confidence is >= THRESHOLD against the rest."""
    source, fields = TASKS[task]
    labels = {r["id"]: r for r in _rows("SELECT * FROM read_csv_auto($p)", {"p": str(REPO / source)})}
    hits = {col: 0 for col in fields}
    whole = valid = 0
    split: dict[str, list[float]] = {"confident": [], "unsure": []}
    bins: list[list[float]] = [[] for _ in range(BINS)]
    unknown = 0
    per_model: dict[str, int] = {}
    for row in predicted:
        label = labels[row["id"]]
        ok = {col: cmp(row.get(col), label[lab]) for col, (lab, cmp) in fields.items()}
        for col, good in ok.items():
            hits[col] += good
        whole += all(ok.values())
        valid += all(row.get(col) is not None for col in fields)
        model = row.get(ANSWERED_BY)
        per_model[str(model)] = per_model.get(str(model), 0) + 1
        confidence = row.get(CONFIDENCE)
        if confidence is None:
            unknown += 1
        else:
            share = sum(ok.values()) / len(ok)
            split["confident" if confidence >= THRESHOLD else "unsure"].append(share)
            bins[min(int(confidence * BINS), BINS - 1)].append(share)
    n = max(len(predicted), 1)
    accuracy = {c: round(h / n, 4) for c, h in hits.items()}
    return {"fields": accuracy, "mean_field_accuracy": _mean(list(accuracy.values())),
            "row_accuracy": round(whole / n, 4), "valid_rate": round(valid / n, 4), "rows_per_model": per_model,
            "calibration": {"threshold": THRESHOLD, "unknown_rows": unknown,
                            **{k: {"rows": len(v), "mean_field_accuracy": _mean(v)} for k, v in split.items()},
                            "bins": [{"from": i / BINS, "rows": len(v), "mean_field_accuracy": _mean(v)}
                                     for i, v in enumerate(bins) if v]}}


def meta_overrides(path: Path, cascade: list[str] | None, min_confidence: float | None) -> list[str]:
    """Overrides that make the task's llm_map step write CONFIDENCE and ANSWERED_BY (and run `cascade`), and
    every SQL step after it carry both through by `id`."""
    steps = load_pipeline(path).steps
    at = next(i for i, step in enumerate(steps) if hasattr(step, "llm_map"))
    out = [f"steps.{at}.llm_map.confidence_column={CONFIDENCE}", f"steps.{at}.llm_map.model_column={ANSWERED_BY}"]
    if cascade:
        out += [f"steps.{at}.llm_map.cascade={json.dumps(cascade)}", f"steps.{at}.llm_map.model=null"]
        if min_confidence is not None:
            out.append(f"steps.{at}.llm_map.min_confidence={min_confidence}")
    for i, step in enumerate(steps[at + 1:], start=at + 1):
        if hasattr(step, "sql"):
            carried = (f"SELECT s.*, i.{CONFIDENCE}, i.{ANSWERED_BY} FROM ({step.sql}) AS s "
                       f"JOIN input AS i USING (id)")
            out.append(f"steps.{i}.sql={json.dumps(carried)}")
        elif hasattr(step, "select"):
            out += [f"steps.{i}.select.{CONFIDENCE}={CONFIDENCE}", f"steps.{i}.select.{ANSWERED_BY}={ANSWERED_BY}"]
    return out


def seconds_by_model(llm_steps: list[dict[str, Any]]) -> dict[str, float]:
    """Wall seconds each model spent over a run's LLM steps (`RunResult.llm_steps`): where a cascade's time
    goes."""
    out: dict[str, float] = {}
    for step in llm_steps:
        for model, seconds in (step.get("seconds_by_model") or {}).items():
            out[model] = round(out.get(model, 0.0) + seconds, 2)
    return out


def run_task(task: str, rows: int, workdir: Path, overrides: list[str], use_cache: bool,
             cascade: list[str] | None = None, min_confidence: float | None = None) -> dict[str, Any]:
    path = REPO / "pipelines" / f"{task}.yaml"
    out = workdir / f"{task}.parquet"
    meta = meta_overrides(path, cascade, min_confidence)
    pipeline = load_pipeline(path, overrides=[f"sink={{parquet: '{out}'}}", *overrides, *meta])
    result = run_pipeline(pipeline, limit=rows, use_cache=use_cache, progress=False)
    predicted = _rows("SELECT * FROM read_parquet($p)", {"p": str(out)})
    return {"rows": len(predicted), "seconds": round(result.seconds, 2),
            "generated_tokens": result.generated_tokens, "tokens_per_s": round(result.tokens_per_s, 2),
            "failed_rows": result.failed_rows, "model": "->".join(cascade) if cascade else pipeline.model,
            "seconds_by_model": seconds_by_model(result.llm_steps), **score(task, predicted)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20, help="rows per task (the first N of each table)")
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--model", default=None, help="run every task on this model (as --set model=MODEL)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="pipeline override for every task, e.g. model=... or engine.device=cuda")
    parser.add_argument("--no-cache", action="store_true", help="recompute every row")
    parser.add_argument("--cascade", default=None, help="comma-separated models: run each task's llm_map as this cascade")
    parser.add_argument("--min-confidence", type=float, default=None, help="the cascade's min_confidence")
    add_record_args(parser)
    args = parser.parse_args(argv)
    if args.model:
        args.overrides.insert(0, f"model={args.model}")
    report = new_record(BENCHMARK, WORKLOAD, None, commit=args.commit)
    cascade = [m.strip() for m in args.cascade.split(",") if m.strip()] if args.cascade else None
    report.update(rows=args.rows, overrides=args.overrides, cascade=cascade, min_confidence=args.min_confidence,
                  tasks={})
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks:
            report["tasks"][task] = run_task(task, args.rows, Path(tmp), args.overrides, not args.no_cache,
                                             cascade, args.min_confidence)
            print(task, json.dumps(report["tasks"][task]), file=sys.stderr)
    done = report["tasks"].values()
    seconds = sum(t["seconds"] for t in done)
    report["model"] = "->".join(cascade) if cascade else ",".join(sorted({str(t["model"]) for t in done})) or None
    report["tokens_per_s"] = round(sum(t["generated_tokens"] for t in done) / seconds, 2) if seconds else None
    save_record(report, args.out)
    return report


if __name__ == "__main__":
    main()
