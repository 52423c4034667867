"""Micro-benchmark: converting an int4 checkpoint's tensors (AWQ GEMM, GPTQ) into our QTensor at load, the
per-code path (one byte per code unpacked, transposed, padded and re-packed: `pack_qtensor`) against the byte
path `awq_qtensor` / `gptq_qtensor` take for whole even groups (AWQ: the nibbles of two rows paired in int32
ops; GPTQ: its int32 words transposed are our bytes).

Cases: Mixtral-8x7B's expert matrices, w1 [14336, 4096] and w2 [4096, 14336], groups of 128, random words.
Both paths must give the same QTensor bit for bit (checked before timing). Times are medians over --repeat
runs on the CPU (loading is host work: `Int4SafetensorsSource`). Appends one record (common fields, one entry
per case, `per_layer_s`: the 24 expert matrices of one Mixtral layer on the byte path) to
benchmarks/records/<machine>/int4_load_speed.jsonl (or --out).

    python benchmarks/kernels/int4_load_speed.py --repeat 5
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import add_record_args, median_ms, new_record, save_record  # noqa: E402
from engine.quant import int4_checkpoint as ic  # noqa: E402
from engine.quant.qtensor import QTensor  # noqa: E402

GROUP = 128
SHAPES = {"w1": (14336, 4096), "w2": (4096, 14336)}          # [out, in] of one expert


def _words(method: str, out_f: int, in_f: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random qweight, qzeros and scales as `method` lays them out for W [out_f, in_f]."""
    g = torch.Generator().manual_seed(out_f * 7 + in_f)
    groups = in_f // GROUP
    words = (in_f, out_f // 8) if method == "awq" else (in_f // 8, out_f)
    qweight = torch.randint(-2**31, 2**31 - 1, words, dtype=torch.int32, generator=g)
    qzeros = torch.randint(-2**31, 2**31 - 1, (groups, out_f // 8), dtype=torch.int32, generator=g)
    scales = torch.rand((groups, out_f), generator=g).to(torch.float16)
    return qweight, qzeros, scales


def _paths(method: str, qweight: torch.Tensor, qzeros: torch.Tensor,
           scales: torch.Tensor) -> dict[str, Callable[[], QTensor]]:
    """The per-code (old) and byte (new) conversions of one tensor."""
    order = ic.AWQ_ORDER if method == "awq" else tuple(range(8))

    def old() -> QTensor:
        codes = ic.unpack_nibbles(qweight, 1 if method == "awq" else 0, order).t().contiguous()
        zeros = ic.unpack_nibbles(qzeros, 1, order).t().to(torch.int16) + (0 if method == "awq" else 1)
        return ic.pack_qtensor(codes, zeros, scales.t(), GROUP, torch.bfloat16)

    def new() -> QTensor:
        if method == "awq":
            return ic.awq_qtensor(qweight, qzeros, scales, GROUP, torch.bfloat16)
        return ic.gptq_qtensor(qweight, qzeros, scales, None, GROUP, torch.bfloat16, zero_offset=1)
    return {"old": old, "new": new}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    add_record_args(ap)
    args = ap.parse_args()
    cpu = torch.device("cpu")
    results = {}
    for method in ("awq", "gptq"):
        for name, (out_f, in_f) in SHAPES.items():
            paths = _paths(method, *_words(method, out_f, in_f))
            a, b = paths["old"](), paths["new"]()
            if not all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("data", "mn", "scale")):
                raise SystemExit(f"{method} {name}: the byte path's QTensor differs from the per-code path's")
            row = {"shape": [out_f, in_f], **{f"{v}_ms": round(median_ms(fn, cpu, args.repeat), 2)
                                              for v, fn in paths.items()}}
            row["speedup"] = round(row["old_ms"] / row["new_ms"], 2)
            results[f"{method}_{name}"] = row
    per_layer = {m: round(8 * (2 * results[f"{m}_w1"]["new_ms"] + results[f"{m}_w2"]["new_ms"]) / 1e3, 2)
                 for m in ("awq", "gptq")}
    record = new_record("int4_load_speed", "mixtral-8x7b", "mixtral-8x7b", commit=args.commit, device="cpu")
    record.update(threads=torch.get_num_threads(), repeat=args.repeat, group_size=GROUP, results=results,
                  per_layer_s=per_layer)
    save_record(record, args.out)
    print(json.dumps({"results": results, "per_layer_s": per_layer}, indent=2))


if __name__ == "__main__":
    main()
