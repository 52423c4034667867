"""The README's Polars snippet on the embedded model: how many rows get a non-null `fields` struct (target
>= 95%: a schema-constrained row always closes its JSON inside max_new_tokens). No result cache, so every
row is generated. One record (common fields, rows_per_h) appended to
benchmarks/records/<machine>/structured_close.jsonl (or --out).

    python benchmarks/accuracy/structured_close.py [--rows 20] [--out /tmp/structured_close.jsonl]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import ROOT, Timer, add_record_args, new_record, rows_per_hour, save_record  # noqa: E402

import polars as pl  # noqa: E402

import llmops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20, help="first N rows of sample_data/tickets.csv")
    add_record_args(ap)
    args = ap.parse_args()
    record = new_record("structured_close", "tickets", "smollm2-135m-instruct", commit=args.commit)

    df = pl.read_csv(ROOT / "sample_data" / "tickets.csv")
    with Timer() as clock:
        out = df.head(args.rows).with_columns(
            llmops.llm_map("Classify this support ticket: {body}", choices=["Bug", "Billing", "Other"],
                           cache_dir=False).alias("label"),
            llmops.llm_map("Extract the order number from: {body}", schema={"order_id": pl.String},
                           cache_dir=False).alias("fields"),
        )
    record.update(rows=out.height, non_null=out["fields"].is_not_null().sum(),
                  label_non_null=out["label"].is_not_null().sum(), seconds=round(clock.seconds, 1),
                  rows_per_h=rows_per_hour(out.height, clock.seconds))
    save_record(record, args.out)
    print(json.dumps({k: record[k] for k in ("rows", "non_null", "label_non_null", "seconds")}))


if __name__ == "__main__":
    main()
