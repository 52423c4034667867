"""The Ray runner on this machine: rows/s with 1 and 2 engine actors, and the sample pipelines on Ray against
the local runner (same rows, same values, same order).

    python benchmarks/operators/ray_scale.py --rows 96 --max-new-tokens 16            # scale: 1 and 2 CPU actors
    python benchmarks/operators/ray_scale.py --samples --limit 4 --no-scale           # sample pipelines, both runners

Scale: `llmops.ray.map_dataset` over the first `--rows` addresses of sample_data/addresses.csv with the model
(default the embedded SmolLM2-135M), result cache off, each configuration in a fresh local Ray instance
with actors + 1 logical CPUs (each actor takes one; the reads one more); the time counts from the first
call until the last row arrives, actor start-up and model load included (`load_s` is one actor's start-up,
measured separately in an untimed first pass). Samples: every `pipelines/*.yaml` but the benchmark ones,
`--limit` rows, `--no-cache`, through `llmops run --runner local` and `--runner ray` (click's runner, one
process); `equal` compares the two sinks row by row.

Output: one record appended to benchmarks/records/<machine>/ray_scale.jsonl (or --out) with `configs` (actors,
seconds, rows_per_s, speedup over one actor) and `samples` (pipeline, rows, equal, seconds per runner).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import ROOT, add_record_args, new_record, save_record  # noqa: E402

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import ray  # noqa: E402
import ray.data  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from llmops.cli import main as cli_main  # noqa: E402
from llmops.core import MapSpec  # noqa: E402
from llmops.ray import map_dataset  # noqa: E402

TEMPLATE = "Record {id}. In one word, which city is this address in? {address}"
SKIP = {"bench_invoices.yaml"}


def address_rows(n: int) -> pa.Table:
    with open(ROOT / "sample_data" / "addresses.csv", newline="", encoding="utf-8") as f:
        base = [r["address"] for r in csv.DictReader(f)]
    return pa.table({"id": list(range(n)), "address": [base[i % len(base)] for i in range(n)]})


def scale(spec: MapSpec, rows: int, actors: list[int], batch_rows: int) -> list[dict[str, Any]]:
    table = address_rows(rows)
    out: list[dict[str, Any]] = []
    for n in actors:
        ray.init(num_cpus=n + 1, include_dashboard=False, log_to_driver=False)
        try:
            start = time.perf_counter()
            ds = map_dataset(ray.data.from_arrow(table).repartition(max(n * 2, 1)), spec, output="city",
                             num_engines=n, batch_rows=batch_rows, cache_dir=False)
            got = sum(ray.get(ref).num_rows for ref in ds.to_arrow_refs())
            seconds = time.perf_counter() - start
        finally:
            ray.shutdown()
        if got != rows:
            raise SystemExit(f"{n} actor(s): {got} rows came back for {rows}")
        out.append({"actors": n, "rows": rows, "seconds": round(seconds, 3), "rows_per_s": round(rows / seconds, 3)})
        print(f"[ray_scale] {n} actor(s): {seconds:.1f}s, {rows / seconds:.2f} rows/s", file=sys.stderr)
    for rec in out:
        rec["speedup"] = round(rec["rows_per_s"] / out[0]["rows_per_s"], 3)
    return out


def samples(limit: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"ray_scale_{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    for path in sorted((ROOT / "pipelines").glob("*.yaml")):
        if path.name in SKIP:
            continue
        rec: dict[str, Any] = {"pipeline": path.name, "rows": limit}
        tables = {}
        for runner in ("local", "ray"):
            sink = work / f"{path.stem}_{runner}.parquet"
            start = time.perf_counter()
            res = CliRunner().invoke(cli_main, ["run", str(path), "--runner", runner, "--limit", str(limit),
                                                "--no-cache", "--allow-errors", "--no-progress",
                                                "--set", f"sink={json.dumps({'parquet': str(sink)})}"])
            rec[f"{runner}_seconds"] = round(time.perf_counter() - start, 3)
            if res.exit_code != 0:
                rec[f"{runner}_error"] = res.output[-500:]
                continue
            tables[runner] = pq.read_table(sink).to_pylist()
        rec["equal"] = len(tables) == 2 and tables["local"] == tables["ray"]
        rec["rows_out"] = len(tables.get("local", []))
        out.append(rec)
        print(f"[ray_scale] {path.name}: equal={rec['equal']}", file=sys.stderr)
    if ray.is_initialized():
        ray.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--actors", default="1,2", help="comma-separated actor counts")
    ap.add_argument("--batch-rows", type=int, default=16, help="rows per actor call")
    ap.add_argument("--no-scale", action="store_true", help="skip the scale runs")
    ap.add_argument("--samples", action="store_true", help="also run the sample pipelines on both runners")
    ap.add_argument("--limit", type=int, default=4, help="rows per sample pipeline")
    add_record_args(ap)
    args = ap.parse_args()
    spec = MapSpec(template=TEMPLATE, model=args.model, max_new_tokens=args.max_new_tokens,
                   engine=(("device", "cpu"),))
    workload = f"addresses-{args.rows}"
    rec = new_record("ray_scale", workload, args.model, device="cpu", commit=args.commit)
    rec.update(template=TEMPLATE, max_new_tokens=args.max_new_tokens, batch_rows=args.batch_rows,
               torch_threads_per_actor="torch default", configs=None, samples=None)
    if not args.no_scale:
        rec["configs"] = scale(spec, args.rows, [int(a) for a in args.actors.split(",")], args.batch_rows)
        best = max(rec["configs"], key=lambda c: c["rows_per_s"])
        rec["rows_per_h"] = round(best["rows_per_s"] * 3600, 1)
    if args.samples:
        rec["samples"] = samples(args.limit)
    save_record(rec, args.out)


if __name__ == "__main__":
    main()
