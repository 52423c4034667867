"""Micro-benchmark: the routed experts' kernels of `engine.models.moe.experts_grouped_mm` at Mixtral-8x7B's
shape (E = 8 experts, h = 4096, i = 14336, bfloat16) by (token, expert) pairs per call, the number that
`EXPERT_GROUP_BYTES` sets (`expert_slot_bytes` per pair: 2,048 pairs at 128 MiB, 4,096 at 256 MiB).

Per --pairs m (spread evenly over the experts): the gate (or up) projection `torch._grouped_mm` [m, h] x
[E, h, i], the gate and up fused into one [E, h, 2i] weight, the down projection [m, i] x [E, i, h] (each
with its TFLOP/s), SiLU then a product in place against `elementwise.silu_mul` (one fused pass); what sums the
pairs into tokens in the engine: the fused pass with the routing weight as its row scale, each pair's output
copied to its (token, slot) place and the sum over a token's two slots; and the alternative: the routing
weight's product over the output in float32 and in bfloat16, and the `index_add_` of two pairs per token. Times are
medians over --repeat runs (`benchmarks.common.median_ms`, in microseconds). Appends one record (common fields,
one entry per pair count) to benchmarks/records/<machine>/grouped_mm_speed.jsonl (or --out). The record in
benchmarks/records/h100/ holds means of 20 back-to-back runs after 3 warm-up runs (its `provenance` says so).

    python benchmarks/kernels/grouped_mm_speed.py                                  # GPU (bfloat16, sm90)
    python benchmarks/kernels/grouped_mm_speed.py --scale 64 --pairs 64 --repeat 2 --out /tmp/gmm.jsonl  # CPU smoke
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import add_record_args, median_ms, new_record, save_record, torch_device  # noqa: E402
from engine.models.elementwise import silu_mul  # noqa: E402

E, H, I = 8, 4096, 14336          # Mixtral-8x7B's experts, hidden and expert intermediate sizes


def measure(m: int, h: int, i: int, device: torch.device, dtype: torch.dtype, repeat: int) -> dict[str, float]:
    """The kernels of one `experts_grouped_mm` call over m pairs (module docstring)."""
    w1 = torch.randn(E, i, h, device=device, dtype=dtype) * 0.01                 # [E, i, h]
    w2 = torch.randn(E, h, i, device=device, dtype=dtype) * 0.01                 # [E, h, i]
    w13 = torch.randn(E, 2 * i, h, device=device, dtype=dtype) * 0.01            # [E, 2i, h]
    offs = torch.tensor([(j + 1) * m // E for j in range(E)], device=device, dtype=torch.int32)   # [E]
    xs = torch.randn(m, h, device=device, dtype=dtype)                           # [m, h]
    a = torch.randn(m, i, device=device, dtype=dtype)                            # [m, i]
    g, u = torch.randn(m, i, device=device, dtype=dtype), torch.randn(m, i, device=device, dtype=dtype)
    y = torch.randn(m, h, device=device, dtype=dtype)                            # [m, h]
    weight = torch.rand(m, 1, device=device)                                     # [m, 1] float32
    out = torch.zeros(m // 2, h, device=device, dtype=dtype)                     # [m / 2, h]: two pairs a token
    order = torch.randperm(m, device=device)                                     # [m] each pair's (token, slot)
    tok = order // 2                                                             # [m]
    pairs = torch.empty(m, h, device=device, dtype=dtype)                        # [m, h] = [m / 2, 2, h]
    def us(fn) -> float:
        return median_ms(fn, device, repeat, warmup=3) * 1e3

    up = us(lambda: torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs))
    fused_up = us(lambda: torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs))
    down = us(lambda: torch._grouped_mm(a, w2.transpose(1, 2), offs=offs))
    flop = 2 * m * h * i
    return {"up_us": up, "up_tflops": flop / up / 1e6, "w13_us": fused_up, "w13_tflops": 2 * flop / fused_up / 1e6,
            "down_us": down, "down_tflops": flop / down / 1e6,
            "silu_then_mul_us": us(lambda: torch.nn.functional.silu(g).mul_(u)), "fused_us": us(lambda: silu_mul(g, u)),
            "fused_scaled_us": us(lambda: silu_mul(g, u, scale=weight[:, 0])),
            "index_copy_us": us(lambda: pairs.index_copy_(0, order, y)),
            "slot_sum_us": us(lambda: pairs.view(m // 2, 2, h).sum(dim=1)),
            "wmul_f32_us": us(lambda: y.mul(weight)), "wmul_bf16_us": us(lambda: y.mul(weight.to(dtype))),
            "index_add_us": us(lambda: out.index_add_(0, tok, y))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, action="append", help="pairs per call (repeatable; default 1024-16384)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--scale", type=int, default=1, help="divide h and i by this (a CPU smoke run)")
    ap.add_argument("--device", default="auto")
    add_record_args(ap)
    args = ap.parse_args(argv)
    device = torch_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    h, i = H // args.scale, I // args.scale
    rec = new_record("grouped_mm_speed", "mixtral-8x7b", "mixtral-8x7b")
    rec.update(experts=E, hidden_size=h, intermediate_size=i, dtype=str(dtype).removeprefix("torch."),
               repeat=args.repeat, per_pairs={})
    for m in args.pairs or [1024, 2048, 4096, 8192, 16384]:
        rec["per_pairs"][str(m)] = res = measure(m, h, i, device, dtype, args.repeat)
        print(m, {k: round(v, 1) for k, v in res.items()}, flush=True)
    save_record(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
