"""Micro-benchmark: one decode step's matrix products on the CPU in every weight form the CPU could hold.

The matrices are a model's (default SmolLM2-135M: per decoder layer the fused q/k/v, o, gate/up and down
projections, then the output head), one distinct copy per layer, so the weights stream from memory as they
do in a run instead of staying in the cache. Forms:
  float32          dense, `F.linear` (MKL)
  bfloat16         dense, `F.linear` (oneDNN, reordering the matrix on every call)
  bfloat16-onednn  dense, packed once into oneDNN's layout (`engine.models.cpu_linear.pack_onednn`)
  int8             per-output-channel int8 codes, `aten._weight_int8pack_mm` on bfloat16 activations
  int4             4-bit groups of 32 (the engine's compressed weights), `engine.models.cpu_linear.Int4Linear`
                   (`aten._weight_int4pack_mm_for_cpu` on bfloat16 activations; the head stays bfloat16-onednn,
                   as the engine keeps the head dense)
For each batch size (rows multiplied at once: 1, 8, 64) the forms run in interleaved rounds; a round times
one whole step (every layer's products, then the head). Reports the fastest round per (form, rows) in ms
per step and the step's weight bytes over that time (GB/s); each form's ratio to float32 and to
bfloat16-onednn. Appends one record to benchmarks/records/<machine>/cpu_linear_speed.jsonl (or --out).

    python benchmarks/kernels/cpu_linear_speed.py [--rounds 5] [--rows 1,8,64] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import add_record_args, new_record, save_record  # noqa: E402
from engine.models.cpu_linear import linear, onednn_bf16, pack_int4, pack_onednn  # noqa: E402
from engine.quant import QuantConfig, quantize  # noqa: E402

SHAPES = {  # model -> (decoder layers, [(out, in) of each layer's products], head (vocab, hidden))
    "smollm2-135m-instruct": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)], (49152, 576)),
    "qwen2.5-0.5b-instruct": (24, [(1152, 896), (896, 896), (9728, 896), (896, 4864)], (151936, 896)),
}
FORMS = ("float32", "bfloat16", "bfloat16-onednn", "int8", "int4")


def _int8(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127                                  # [n]
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)           # [n, k]
    scale = scale.to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, codes, scale)


def products(form: str, weights: list[torch.Tensor]) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """One callable x [m, k] -> [m, n] per weight, in `form`."""
    if form == "float32":
        return [lambda x, w=w: F.linear(x, w) for w in weights]
    if form == "bfloat16":
        dense = [w.bfloat16() for w in weights]
        return [lambda x, w=w: F.linear(x, w) for w in dense]
    if form == "bfloat16-onednn":
        packed = [pack_onednn(w.bfloat16()) for w in weights]
        return [lambda x, w=w: linear(x, w) for w in packed]
    if form == "int8":
        return [_int8(w) for w in weights]
    if form == "int4":
        packed = [pack_int4(quantize(w.bfloat16(), QuantConfig(group_size=32))) for w in weights]
        return [lambda x, w=w: w(x) for w in packed]
    raise ValueError(f"unknown form {form!r}; known: {FORMS}")


def input_dtype(form: str) -> torch.dtype:
    return torch.float32 if form == "float32" else torch.bfloat16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    add_record_args(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    forms = [f for f in args.forms.split(",") if f and (f != "bfloat16-onednn" or onednn_bf16())]
    layers, shapes, head = SHAPES[args.model]
    gen = torch.Generator().manual_seed(0)
    weights = [0.05 * torch.randn(n, k, generator=gen) for _ in range(layers) for n, k in shapes]
    head_w = 0.05 * torch.randn(*head, generator=gen)
    step_bytes = {}
    calls = {}
    for form in forms:
        body = products(form, weights)
        head_call = products("bfloat16-onednn" if form == "int4" and onednn_bf16() else
                             "bfloat16" if form in ("int4", "int8") else form, [head_w])[0]
        calls[form] = (body, head_call)
        bytes_per = {"float32": 4, "bfloat16": 2, "bfloat16-onednn": 2, "int8": 1, "int4": 0.5 + 4 / 32}[form]
        head_bytes = 4 if form == "float32" else 2
        step_bytes[form] = sum(w.numel() for w in weights) * bytes_per + head_w.numel() * head_bytes
    results: dict[str, dict[str, dict[str, float]]] = {}
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {form: {k: torch.randn(m, k, generator=gen).to(input_dtype(form)) for k in {s[1] for s in shapes}}
              for form in forms}
        best = {form: float("inf") for form in forms}
        for _ in range(args.rounds):
            for form in forms:
                body, head_call = calls[form]
                x = xs[form]
                start = time.perf_counter()
                for f, w in zip(body, weights):
                    f(x[w.shape[1]])
                head_call(x[head[1]])
                best[form] = min(best[form], time.perf_counter() - start)
        results[str(m)] = {form: {"ms_per_step": best[form] * 1e3, "gb_per_s": step_bytes[form] / best[form] / 1e9,
                                  "vs_float32": best["float32"] / best[form] if "float32" in best else None,
                                  "vs_bfloat16_onednn": (best["bfloat16-onednn"] / best[form]
                                                         if "bfloat16-onednn" in best else None)}
                           for form in forms}
        sys.stderr.write(f"rows {m}: " + ", ".join(f"{f} {best[f] * 1e3:.1f} ms" for f in forms) + "\n")
    record = new_record("cpu_linear_speed", "decode-step-products", args.model, device="cpu", commit=args.commit)
    record.update(threads=args.threads, rounds=args.rounds, forms=forms, rows=results,
                  step_weight_bytes=step_bytes, timing="fastest of the interleaved rounds, wall clock",
                  load_average=os.getloadavg())
    save_record(record, args.out)
    sys.stdout.write(json.dumps({m: {f: round(r["ms_per_step"], 2) for f, r in rs.items()}
                                 for m, rs in results.items()}) + "\n")


if __name__ == "__main__":
    main()
