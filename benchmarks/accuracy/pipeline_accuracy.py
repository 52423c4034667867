"""Accuracy of each sample pipeline against the label columns of its sample table.

Runs every `pipelines/*.yaml` task on its first N rows (the pipeline as written: model, prompts, few-shot
examples; only the sink is redirected to a temporary folder) and compares each predicted column with its
label. Appends one record to benchmarks/records/<machine>/pipeline_accuracy.jsonl (or --out):
the common fields (tokens_per_s over all tasks) and {"rows", "overrides", "tasks": {task: {"rows", "seconds",
"generated_tokens", "tokens_per_s", "failed_rows", "model", "valid_rate", "row_accuracy",
"fields": {column: accuracy}}}}.

Usage (from the repository root):
    python benchmarks/accuracy/pipeline_accuracy.py --rows 20
    python benchmarks/accuracy/pipeline_accuracy.py --rows 20 --model qwen2.5-0.5b-instruct
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


def score(task: str, predicted: list[dict]) -> dict[str, Any]:
    """Per-field accuracy, all-fields row accuracy and the share of rows with every field non-null."""
    source, fields = TASKS[task]
    labels = {r["id"]: r for r in _rows("SELECT * FROM read_csv_auto($p)", {"p": str(REPO / source)})}
    hits = {col: 0 for col in fields}
    whole = valid = 0
    for row in predicted:
        label = labels[row["id"]]
        ok = {col: cmp(row.get(col), label[lab]) for col, (lab, cmp) in fields.items()}
        for col, good in ok.items():
            hits[col] += good
        whole += all(ok.values())
        valid += all(row.get(col) is not None for col in fields)
    n = max(len(predicted), 1)
    return {"fields": {c: round(h / n, 4) for c, h in hits.items()}, "row_accuracy": round(whole / n, 4),
            "valid_rate": round(valid / n, 4)}


def run_task(task: str, rows: int, workdir: Path, overrides: list[str], use_cache: bool) -> dict[str, Any]:
    path = REPO / "pipelines" / f"{task}.yaml"
    out = workdir / f"{task}.parquet"
    pipeline = load_pipeline(path, overrides=[f"sink={{parquet: '{out}'}}", *overrides])
    result = run_pipeline(pipeline, limit=rows, use_cache=use_cache, progress=False)
    predicted = _rows("SELECT * FROM read_parquet($p)", {"p": str(out)})
    return {"rows": len(predicted), "seconds": round(result.seconds, 2),
            "generated_tokens": result.generated_tokens, "tokens_per_s": round(result.tokens_per_s, 2),
            "failed_rows": result.failed_rows, "model": pipeline.model, **score(task, predicted)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20, help="rows per task (the first N of each table)")
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--model", default=None, help="run every task on this model (as --set model=MODEL)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="pipeline override for every task, e.g. model=... or engine.device=cuda")
    parser.add_argument("--no-cache", action="store_true", help="recompute every row")
    add_record_args(parser)
    args = parser.parse_args(argv)
    if args.model:
        args.overrides.insert(0, f"model={args.model}")
    report = new_record(BENCHMARK, WORKLOAD, None, commit=args.commit)
    report.update(rows=args.rows, overrides=args.overrides, tasks={})
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks:
            report["tasks"][task] = run_task(task, args.rows, Path(tmp), args.overrides, not args.no_cache)
            print(task, json.dumps(report["tasks"][task]), file=sys.stderr)
    done = report["tasks"].values()
    seconds = sum(t["seconds"] for t in done)
    report["model"] = ",".join(sorted({str(t["model"]) for t in done})) or None
    report["tokens_per_s"] = round(sum(t["generated_tokens"] for t in done) / seconds, 2) if seconds else None
    save_record(report, args.out)
    return report


if __name__ == "__main__":
    main()
