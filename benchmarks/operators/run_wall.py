"""Wall time of what `make run` runs, per engine dtype: `llmops run <pipeline> --limit N --allow-errors --no-cache`
in a fresh process (the embedded model already installed, the result cache off), timed from outside the
process, and how many of its output rows equal those of the float32 run (the reference arithmetic).

Each dtype in --dtypes runs once, in order, as `--set engine.dtype=<dtype>` ("auto": the machine's own
choice; "pipeline": no --set, the dtype the pipeline file asks for, what `make run` gets). One record: common
fields, per dtype the wall seconds, the pipeline's own seconds and the grammar's part of them (masks and feeding
tokens, from the run report), generated tokens, failed rows and rows equal to float32's; workload the pipeline's
name; tokens_per_s the first dtype's.
Appended to benchmarks/records/<machine>/run_wall.jsonl (or --out).

    python benchmarks/operators/run_wall.py [--pipeline pipelines/extract_invoices.yaml] [--limit 80]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import ROOT, add_record_args, new_record, save_record  # noqa: E402
from benchmarks.operators.invoice_job import run_llmops  # noqa: E402


AS_WRITTEN = "pipeline"           # a --dtypes entry: the pipeline file's own engine.dtype


def run_once(pipeline: Path, limit: int, dtype: str, sink: Path) -> dict[str, Any]:
    """One fresh-process run writing `sink`: wall seconds from outside, and the run's own summary."""
    options = ["--limit", str(limit), "--allow-errors", "--no-cache", "--no-progress", "--json",
               *([] if dtype == AS_WRITTEN else ["--set", f"engine.dtype={dtype}"])]
    path = pipeline.resolve()
    summary, seconds, _ = run_llmops(["run", str(path), *options, "--set", f"sink.parquet={sink}"],
                                     f"llmops run ({dtype})")
    argv = ["llmops", "run", str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path), *options]
    report = json.loads(Path(summary["report"]).read_text())
    grammar_s = sum(step["time"]["grammar_mask"] for step in report["llm_steps"])
    return {"dtype": dtype, "seconds": round(seconds, 2), "pipeline_s": round(float(summary["seconds"]), 2),
            "grammar_s": round(grammar_s, 2), "grammar_share": round(grammar_s / float(summary["seconds"]), 4),
            "generated_tokens": summary["generated_tokens"], "failed_rows": summary["failed_rows"],
            "rows_written": summary["rows_written"], "llmops_argv": argv}


def main() -> None:
    import pyarrow.parquet as pq

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", type=Path, default=ROOT / "pipelines" / "extract_invoices.yaml")
    ap.add_argument("--limit", type=int, default=80, help="source rows (make run's RUN_ARGS: 80)")
    ap.add_argument("--dtypes", default=f"{AS_WRITTEN},auto,float32",
                    help=f"comma-separated engine dtypes ({AS_WRITTEN!r}: the file's own); float32 is the reference")
    add_record_args(ap)
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    if "float32" not in dtypes:
        dtypes.append("float32")
    runs, tables = [], {}
    with tempfile.TemporaryDirectory(prefix="run_wall_") as work:
        for dtype in dtypes:
            sink = Path(work) / f"{dtype}.parquet"
            runs.append(run_once(args.pipeline, args.limit, dtype, sink))
            tables[dtype] = pq.read_table(sink).to_pylist()
    reference = tables["float32"]
    for run in runs:
        rows = tables[run["dtype"]]
        same_rows = len(rows) == len(reference)              # else the runs wrote different rows: not comparable
        run["rows_equal_to_float32"] = sum(a == b for a, b in zip(rows, reference)) if same_rows else None
        print(f"{run['dtype']}: {run['seconds']} s, "
              f"{run['rows_equal_to_float32']}/{len(reference)} rows equal float32's")
    record = new_record("run_wall", args.pipeline.stem.replace("_", "-"), "smollm2-135m-instruct", commit=args.commit)
    record.update(rows=args.limit, runs=runs,
                  tokens_per_s=round(runs[0]["generated_tokens"] / runs[0]["pipeline_s"], 1))
    save_record(record, args.out)


if __name__ == "__main__":
    main()
