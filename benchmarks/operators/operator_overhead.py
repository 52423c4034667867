"""Operator overhead: the same prompts through the engine directly, Polars `llm_map`, DuckDB's scalar
`llm_map` UDF (2048-row chunks) and DuckDB `map_relation`; ratios of direct time to operator time
(target >= 0.9 each) as one record (common fields; rows_per_h / tokens_per_s of the direct path) appended to
benchmarks/records/<machine>/operator_overhead.jsonl (or --out).

    python benchmarks/operators/operator_overhead.py --rows 10000 --max-new-tokens 4 \
        [--model smollm2-135m-instruct] [--out /tmp/operator_overhead.jsonl]

Every prompt is distinct (the row number is part of it) so deduplication does not flatter the operators,
and the result cache is off (cache_dir=False) so each path really generates. The direct path runs first
and last (the faster of the two counts) so warm-up and machine drift do not flatter the operators.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import duckdb
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import ROOT, Timer, add_record_args, new_record, rows_per_hour, save_record  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from llmops.core import MapSpec, sampling_params  # noqa: E402
from llmops.duckdb import map_relation, register  # noqa: E402
from llmops.polars import llm_map  # noqa: E402
from llmops.templates import render  # noqa: E402

BENCHMARK, WORKLOAD = "operator_overhead", "addresses"
TEMPLATE = "Record {id}. In one word, which city is this address in? {address}"


def rows(n: int) -> list[dict[str, str]]:
    with open(ROOT / "sample_data" / "addresses.csv", newline="", encoding="utf-8") as f:
        base = [r["address"] for r in csv.DictReader(f)]
    return [{"id": str(i), "address": base[i % len(base)]} for i in range(n)]


def timed(fn) -> tuple[float, object]:
    """(seconds, fn())."""
    with Timer() as t:
        out = fn()
    return t.seconds, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="auto")
    add_record_args(ap)
    args = ap.parse_args()
    record = new_record(BENCHMARK, WORKLOAD, args.model, commit=args.commit)

    data = rows(args.rows)
    spec = MapSpec(TEMPLATE, model=args.model, max_new_tokens=args.max_new_tokens)
    params: SamplingParams = sampling_params(spec)
    llm = LLM(args.model, device=args.device)
    llm.generate([render(TEMPLATE, r) for r in data[:8]], params)          # warm-up: policy, kernels

    prompts = [render(TEMPLATE, r) for r in data]
    t_direct, completions = timed(lambda: llm.generate(prompts, params))
    tokens = sum(len(c.token_ids) for c in completions)

    df = pl.DataFrame(data)
    expr = llm_map(TEMPLATE, model=args.model, max_new_tokens=args.max_new_tokens, cache_dir=False,
                   progress=False, engine=llm)
    t_polars, out = timed(lambda: df.with_columns(expr.alias("city")))
    assert out["city"].null_count() == 0

    con = duckdb.connect()
    con.execute("CREATE TABLE t AS SELECT * FROM df")
    register(con, model=args.model, max_new_tokens=args.max_new_tokens, cache_dir=False, engine=llm)
    t_duck, got = timed(lambda: con.execute(
        f"SELECT count(llm_map('{TEMPLATE}', {{'id': id, 'address': address}})) FROM t").fetchall())
    assert got == [(args.rows,)]
    t_rel, rel = timed(lambda: map_relation(con, "SELECT * FROM t", TEMPLATE, model=args.model,
                                            max_new_tokens=args.max_new_tokens, cache_dir=False,
                                            progress=False, engine=llm).to_arrow_table())
    assert rel.num_rows == args.rows
    t_direct = min(t_direct, timed(lambda: llm.generate(prompts, params))[0])   # direct before and after

    result = {
        **record, "rows_per_h": rows_per_hour(args.rows, t_direct), "tokens_per_s": tokens / t_direct,
        "rows": args.rows, "max_new_tokens": args.max_new_tokens,
        "generated_tokens_direct": tokens,
        "seconds": {"direct": t_direct, "polars": t_polars, "duckdb_udf": t_duck, "duckdb_relation": t_rel},
        "ratio_vs_direct": {"polars": t_direct / t_polars, "duckdb_udf": t_direct / t_duck,
                            "duckdb_relation": t_direct / t_rel},
        "target": 0.9,
        "policy": str(llm.policy), "engine_device": str(llm.device),
    }
    save_record(result, args.out)
    print(json.dumps(result["ratio_vs_direct"], indent=2))


if __name__ == "__main__":
    main()
