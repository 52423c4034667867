"""The README's Polars snippet on the embedded model: how many rows get a non-null `fields` struct (target
>= 95%: a schema-constrained row always closes its JSON inside max_new_tokens). No result cache, so every
row is generated.

    .venv/bin/python benchmarks/structured_close.py [--rows 20] [--out benchmarks/results/structured_close.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import polars as pl  # noqa: E402

import llmops  # noqa: E402


def commit() -> str:
    """`git rev-parse --short HEAD` of the checkout, or "unknown" without git."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20, help="first N rows of sample_data/tickets.csv")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "structured_close.json"))
    args = ap.parse_args()

    df = pl.read_csv(ROOT / "sample_data" / "tickets.csv")
    start = time.perf_counter()
    out = df.head(args.rows).with_columns(
        llmops.llm_map("Classify this support ticket: {body}", choices=["Bug", "Billing", "Other"],
                       cache_dir=False).alias("label"),
        llmops.llm_map("Extract the order number from: {body}", schema={"order_id": pl.String},
                       cache_dir=False).alias("fields"),
    )
    seconds = time.perf_counter() - start
    record = {
        "command": " ".join([_relative(Path(sys.executable)), *sys.argv]),
        "rows": out.height,
        "non_null": out["fields"].is_not_null().sum(),
        "label_non_null": out["label"].is_not_null().sum(),
        "seconds": round(seconds, 1),
        "machine": "dev CPU 2 cores",
        "commit": commit(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
