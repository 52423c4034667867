"""Accuracy of the semantic operators' sample pipelines against their labels, on their model or `--model`.

- `resolve_customers` (resolve): pairwise precision / recall / F1 of the entity ids against `label_entity`,
  pairs compared vs all pairs, and the blocking's recall of the true pairs;
- `join_products` (llm_join): over the labelled pairs of `products_pairs.csv`, a pair is predicted a match
  when the join returns it (confidence >= the pipeline's min_confidence, 1.0, and again at 0.5 from the
  result cache): accuracy, precision, recall, and the share of labelled matches that blocking kept;
- `reduce_tickets` (llm_reduce): share of ticket groups whose reduced category is the group's label, and the
  calls per folding level.
The pipelines run as written (sink redirected to a temporary folder); `--rows N` limits the source (and
llm_join's right table) to N rows. Appends one record to benchmarks/records/<machine>/semantic_accuracy.jsonl
(or --out).

Usage (from the repository root): python benchmarks/accuracy/semantic_accuracy.py [--rows 120] [--tasks resolve_customers]
    [--model qwen2.5-0.5b-instruct]
"""
from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import ROOT, add_record_args, new_record, save_record  # noqa: E402
from llmops.pipeline.load import load_pipeline  # noqa: E402
from llmops.pipeline.runner import run_pipeline  # noqa: E402
from llmops.semantic.blocking import (Blocking, blocking_text, candidate_pairs, cross_candidate_pairs,  # noqa: E402
                                      pair_recall)
from llmops.semantic.components import pair_scores, true_pairs  # noqa: E402

TASKS = ("resolve_customers", "join_products", "reduce_tickets")


def _csv(name: str) -> list[dict[str, str]]:
    with open(ROOT / "sample_data" / name, encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _blocking(settings: Any) -> Blocking:
    return Blocking(tuple(settings.keys), settings.q, settings.threshold, settings.top_k, settings.max_posting)


def score_resolve(out: dict[str, list[Any]], step: dict[str, Any], cfg: Any) -> dict[str, Any]:
    labels = {int(r["id"]): r["label_entity"] for r in _csv("customers_dupes.csv")}
    truth = [labels[i] for i in out["id"]]
    scores = pair_scores(out["entity_id"], truth)
    texts = [blocking_text({"name": n, "city": c}, ["name", "city"]) for n, c in zip(out["name"], out["city"])]
    found = candidate_pairs(texts, [out["phone_key"]], _blocking(cfg.blocking))
    scores["blocking_recall_of_true_pairs"] = pair_recall(found, true_pairs(truth))
    return {**{k: round(v, 4) if isinstance(v, float) else v for k, v in scores.items()},
            **{k: step.get(k) for k in ("all_pairs", "candidate_pairs", "compared_pairs", "matched_pairs", "entities")},
            "true_entities": len(set(truth))}


def score_join(out: dict[str, list[Any]], step: dict[str, Any], rows: int | None, cfg: Any) -> dict[str, Any]:
    pairs = _csv("products_pairs.csv")[:rows] if rows else _csv("products_pairs.csv")
    found_blocks = cross_candidate_pairs([p["left_title"] for p in pairs], [p["right_title"] for p in pairs],
                                         blocking=_blocking(cfg.blocking))
    kept = sum((k, k) in found_blocks for k, p in enumerate(pairs) if p["label"] == "match")
    found = {(str(a), str(b)) for a, b in zip(out["id"], out["id_right"])}
    tp = fp = fn = tn = 0
    for p in pairs:
        predicted, actual = (p["id"], p["id"]) in found, p["label"] == "match"
        tp, fp = tp + (predicted and actual), fp + (predicted and not actual)
        fn, tn = fn + (actual and not predicted), tn + (not actual and not predicted)
    n = tp + fp + fn + tn
    return {"labelled_pairs": n, "accuracy": round((tp + tn) / n, 4), "precision": round(tp / (tp + fp), 4) if tp + fp else None,
            "recall": round(tp / (tp + fn), 4) if tp + fn else None, "tp": tp, "fp": fp, "fn": fn, "tn": tn,
            "blocking_recall_of_labelled_matches": round(kept / (tp + fn), 4) if tp + fn else None,
            "all_pairs": step.get("all_pairs"), "candidate_pairs": step.get("candidate_pairs"),
            "prompts": step.get("prompts"), "matched_pairs": step.get("matched_pairs")}


def score_reduce(out: dict[str, list[Any]], step: dict[str, Any]) -> dict[str, Any]:
    right = sum(c == label for c, label in zip(out["category"], out["label"]))
    return {"groups": len(out["label"]), "accuracy": round(right / len(out["label"]), 4),
            "levels": step.get("levels"), "budget_tokens": step.get("budget")}


def run_task(task: str, rows: int | None, folder: Path, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    overrides = [f"sink.parquet={folder / task}.parquet", *extra]
    if rows and task == "join_products":
        right = f"SELECT * FROM read_csv('sample_data/products_right.csv', all_varchar = true) LIMIT {rows}"
        overrides.append(f"steps.0.llm_join.right={right}")
    pipeline = load_pipeline(ROOT / "pipelines" / "semantic" / f"{task}.yaml", overrides=overrides)
    start = time.perf_counter()
    result = run_pipeline(pipeline, limit=rows if task == "join_products" else None, progress=False)
    seconds = time.perf_counter() - start
    out = pq.read_table(folder / f"{task}.parquet").to_pydict()
    step = next(s for s in result.llm_steps if "kind" in s)
    cfg = next(getattr(s, k) for s in pipeline.steps for k in ("resolve", "llm_join") if hasattr(s, k)) \
        if task != "reduce_tickets" else None
    score = {"resolve_customers": lambda: score_resolve(out, step, cfg),
             "join_products": lambda: score_join(out, step, rows, cfg),
             "reduce_tickets": lambda: score_reduce(out, step)}[task]()
    return {"source_rows": result.source_rows, "seconds": round(seconds, 1), "generated_tokens": result.generated_tokens,
            "prompt_tokens": result.prompt_tokens, "llm_prompts": step.get("generated_rows"),
            "failed_rows": result.failed_rows, "cache_hits": result.cache_hits, "model": pipeline.model, **score}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=None, help="llm_join: source and right rows (default all)")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--model", default=None, help="run every task on this model (default: the pipelines' own)")
    add_record_args(ap)
    args = ap.parse_args()
    model = (f"model={args.model}",) if args.model else ()
    record = new_record("semantic_accuracy", "sample-pipelines", args.model or "smollm2-135m-instruct",
                        commit=args.commit)
    tasks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks.split(","):
            tasks[task] = run_task(task, args.rows, Path(tmp), model)
            print(task, tasks[task], flush=True)
            if task == "join_products":   # the same answers (result cache) at the lower confidence bar
                low = run_task(task, args.rows, Path(tmp), (*model, "steps.0.llm_join.min_confidence=0.5"))
                tasks[task]["at_min_confidence_0.5"] = {k: low[k] for k in ("accuracy", "precision", "recall",
                                                                           "tp", "fp", "fn", "tn", "matched_pairs")}
    record.update(rows=args.rows, tasks=tasks)
    save_record(record, args.out)


if __name__ == "__main__":
    main()
