"""Blocking for `resolve` on 1,000 customer records: pairs compared against brute force, and recall of the
true duplicate pairs (no model: blocking decides which pairs the model would ever see).

Draws ~1,000 records with duplicates (`sample_data/make_entity_samples.customer_records`), renders them as
`resolve` does (name and city), and for each blocking setting counts candidate pairs, their share of all
n(n-1)/2 pairs, the recall of the true pairs (same `label_entity`), and the time. Appends one record to
benchmarks/records/<machine>/resolve_blocking.jsonl (or --out).

Usage (from the repository root): python benchmarks/accuracy/resolve_blocking.py [--rows 1000]
"""
from __future__ import annotations

import argparse
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import ROOT, add_record_args, new_record, save_record  # noqa: E402

sys.path.insert(0, str(ROOT / "sample_data"))
from make_entity_samples import customer_records  # noqa: E402

from llmops.semantic.blocking import Blocking, blocking_text, candidate_pairs, pair_recall  # noqa: E402
from llmops.semantic.components import true_pairs  # noqa: E402

SETTINGS = {  # name -> (Blocking, use the phone key)
    "qgram-0.35-top5+phone": (Blocking(keys=("phone_key",), threshold=0.35, top_k=5), True),
    "qgram-0.35-top10": (Blocking(threshold=0.35, top_k=10), False),
    "qgram-0.5-top3": (Blocking(threshold=0.5, top_k=3), False),
    "phone-key-only": (Blocking(keys=("phone_key",), threshold=None), True),
}


def records(rows: int, seed: int = 7) -> list[dict]:
    """About `rows` records (entities drawn until the count is reached), with the pipeline's phone key."""
    rng, entities = random.Random(seed), max(1, rows // 2 + 10)  # 2 records per entity on average
    out = customer_records(rng, entities)[:rows]
    for r in out:
        r["phone_key"] = re.sub(r"[^0-9]", "", r["phone"])[-9:] or None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1000)
    add_record_args(ap)
    args = ap.parse_args()
    rows = records(args.rows)
    texts = [blocking_text(r, ["name", "city"]) for r in rows]
    truth = true_pairs([r["label_entity"] for r in rows])
    n = len(rows)
    record = new_record("resolve_blocking", f"customers-{n}", None, commit=args.commit)
    results = {}
    for name, (blocking, _) in SETTINGS.items():
        start = time.perf_counter()
        found = candidate_pairs(texts, [[r[k] for r in rows] for k in blocking.keys], blocking)
        seconds = time.perf_counter() - start
        results[name] = {"blocking": {"keys": list(blocking.keys), "q": blocking.q, "threshold": blocking.threshold,
                                      "top_k": blocking.top_k, "max_posting": blocking.max_posting},
                         "pairs_compared": len(found), "share_of_all_pairs": round(len(found) / (n * (n - 1) / 2), 5),
                         "recall_of_true_pairs": round(pair_recall(found, truth), 4), "seconds": round(seconds, 3)}
        print(f"{name}: {len(found)} pairs of {n * (n - 1) // 2}, recall {results[name]['recall_of_true_pairs']}")
    record.update(rows=n, entities=len({r["label_entity"] for r in rows}), all_pairs=n * (n - 1) // 2,
                  true_pairs=len(truth), brute_force_recall=1.0, settings=results,
                  pipeline_setting="qgram-0.35-top5+phone")
    save_record(record, args.out)


if __name__ == "__main__":
    main()
