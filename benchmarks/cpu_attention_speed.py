"""CPU decode attention rate: the engine's kernel in each cache dtype against FlexGen's fp32 upcast.

One decode step's attention over a host KV cache (b rows, nkv heads, t positions, head_dim hd), as the
executor runs it when the cache lives on the cpu tier with cpu_attention: `cpu_decode_attention` in fp16,
bf16 and fp32, and FlexGen's way (upcast the whole cache to fp32, then attend). Reports seconds per call and
the cache bytes read per second (keys + values in the stored dtype). Writes one record (common fields, one
entry per kernel and dtype) to --out, default cpu_attention_speed_opt-30b.json (the default shape, OPT-30B's
heads; another shape: cpu_attention_speed_b<batch>-h<heads>-t<context>-d<head_dim>.json) in $OUT or
benchmarks/results/.

    python benchmarks/cpu_attention_speed.py --out /tmp/cpu_attention.json      # OPT-30B-like shape
    python benchmarks/cpu_attention_speed.py --batch 2 --heads 4 --context 64 --repeats 2 --out /tmp/a.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/: bench_common
from bench_common import Timer, add_record_args, new_record, results_path, save_record  # noqa: E402

import torch  # noqa: E402

from engine.models.attention import cpu_decode_attention, decode_attention  # noqa: E402


def _time(fn, repeats: int) -> float:
    fn()
    with Timer() as t:
        for _ in range(repeats):
            fn()
    return t.seconds / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--context", type=int, default=544)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    add_record_args(ap)
    args = ap.parse_args()
    b, h, t, hd = args.batch, args.heads, args.context, args.head_dim
    workload = "opt-30b" if (b, h, t, hd) == (16, 56, 544, 128) else f"b{b}-h{h}-t{t}-d{hd}"
    record = new_record("cpu_attention_speed", workload, None, device="cpu", commit=args.commit)
    g = torch.Generator().manual_seed(0)
    q32 = torch.randn(b, h, 1, hd, generator=g)
    k32 = torch.randn(b, h, t, hd, generator=g)
    v32 = torch.randn(b, h, t, hd, generator=g)
    valid = torch.ones(b, t, dtype=torch.bool)
    rows = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        q, k, v = q32.to(dtype), k32.to(dtype), v32.to(dtype)
        cache_bytes = 2 * k.numel() * k.element_size()
        s = _time(lambda: cpu_decode_attention(q, k, v, valid, 0.1), args.repeats)
        rows.append({"kernel": "engine", "dtype": str(dtype)[6:], "s": s, "gb_s": cache_bytes / s / 1e9})
        if dtype is not torch.float32:
            s = _time(lambda: decode_attention(q.float(), k.float(), v.float(), valid, 0.1), args.repeats)
            rows.append({"kernel": "fp32 upcast (FlexGen)", "dtype": str(dtype)[6:], "s": s,
                         "gb_s": cache_bytes / s / 1e9})
    for r in rows:
        print(f"{r['kernel']:24s} {r['dtype']:9s} {r['s'] * 1e3:8.2f} ms  {r['gb_s']:6.2f} GB/s")
    record.update(shape={"batch": b, "heads": h, "context": t, "head_dim": hd}, threads=torch.get_num_threads(),
                  results=rows)
    save_record(args.out or results_path("cpu_attention_speed", workload), record, indent=1)


if __name__ == "__main__":
    main()
