"""City extraction with a JSON schema over sample_data/addresses.csv, few-shot or --zero-shot: exact-match
accuracy of `city` (target >= 0.8) and the share of valid (finished, parsed) outputs (target 1.0), as one
record (common fields, rows_per_h) appended to benchmarks/records/<machine>/address_accuracy.jsonl (or --out).

    python benchmarks/accuracy/address_accuracy.py [--limit N] [--dtype float32] [--out /tmp/address_accuracy.jsonl]
    python benchmarks/accuracy/address_accuracy.py --model qwen2.5-0.5b-instruct --zero-shot
"""
from __future__ import annotations

import argparse
import json
import sys
import unicodedata
from pathlib import Path

import pyarrow.csv as pacsv

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import ROOT, Timer, add_record_args, new_record, rows_per_hour, save_record  # noqa: E402
from llmops.core import MapSpec, last_summary, map_table_ordered  # noqa: E402

BENCHMARK, WORKLOAD = "address_accuracy", "addresses"
TEMPLATE = "Extract the city from this address: {address}"
SYSTEM = "You extract the city (the locality name as written in the address) and answer in JSON."
EXAMPLES = (
    {"input": {"address": "48 Rue de Rivoli, 75004 Paris, France"}, "output": {"city": "Paris"}},
    {"input": {"address": "742 Evergreen Terrace, Portland, OR 97205"}, "output": {"city": "Portland"}},
    {"input": {"address": "Flat 2, 5 High Street, York YO1 7HS, UK"}, "output": {"city": "York"}},
    {"input": {"address": "Hauptstrasse 12, 69117 Heidelberg, Germany"}, "output": {"city": "Heidelberg"}},
    {"input": {"address": "Via Garibaldi 9, 10122 Torino, Italia"}, "output": {"city": "Torino"}},
    {"input": {"address": "Storgatan 5, 411 38 Göteborg, Sweden"}, "output": {"city": "Göteborg"}},
    {"input": {"address": "9 Mill Lane, Sheffield S1 2HE"}, "output": {"city": "Sheffield"}},
)


def norm(text: str | None) -> str:
    return unicodedata.normalize("NFC", text or "").strip().casefold()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="auto", help="engine dtype: auto (bfloat16), float32, ...")
    ap.add_argument("--zero-shot", action="store_true", help="no examples: the system prompt and template only")
    add_record_args(ap)
    args = ap.parse_args()
    record = new_record(BENCHMARK, WORKLOAD, args.model, commit=args.commit)

    table = pacsv.read_csv(ROOT / "sample_data" / "addresses.csv")
    if args.limit:
        table = table.slice(0, args.limit)
    examples = () if args.zero_shot else EXAMPLES
    spec = MapSpec(TEMPLATE, model=args.model, system=SYSTEM, examples=examples, schema={"city": str},
                   max_new_tokens=args.max_new_tokens, engine={"dtype": args.dtype})
    with Timer() as clock:
        out = map_table_ordered(table, spec, cache_dir=False, progress=None)
    seconds = clock.seconds
    labels = table.column("city").to_pylist()
    outputs = out.column("output").to_pylist()
    valid = [o is not None and r == "stop" for o, r in zip(outputs, out.column("finish_reason").to_pylist())]
    exact = [o is not None and o["city"] == lab for o, lab in zip(outputs, labels)]
    loose = [o is not None and norm(o["city"]) == norm(lab) for o, lab in zip(outputs, labels)]
    misses = [{"address": a, "label": lab, "got": o and o["city"]}
              for a, lab, o, ok in zip(table.column("address").to_pylist(), labels, outputs, exact) if not ok]
    n = table.num_rows
    result = {**record, "rows_per_h": rows_per_hour(n, seconds), "rows": n, "dtype": args.dtype, "shots": len(examples), "exact_match": sum(exact) / n, "casefold_match": sum(loose) / n,
              "valid_outputs": sum(valid) / n, "targets": {"exact_match": 0.8, "valid_outputs": 1.0},
              "seconds": seconds, "summary": last_summary().to_dict(), "misses": misses}
    save_record(result, args.out)
    print(json.dumps({k: result[k] for k in ("rows", "shots", "exact_match", "casefold_match", "valid_outputs", "seconds")}))


if __name__ == "__main__":
    main()
