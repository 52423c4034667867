"""CPU decode attention rate: the engine's kernel per cache dtype (and 4-bit) against FlexGen's fp32 upcast.

One decode step's attention over a host KV cache (b rows, nkv kv heads, nh query heads, t positions, head_dim
hd), as the executor runs it when the cache lives on the cpu tier with cpu_attention: `cpu_decode_attention`
in fp16, bf16 and fp32, over a 4-bit cache (`engine.quant`, dequantized per chunk of rows) at several chunk
sizes (--chunk-mib), and FlexGen's way (upcast the whole cache to fp32, then attend). Reports seconds per
call, the cache bytes read per second as stored (`gb_s`; for 4-bit the packed bytes) and in dense bf16
equivalent (`dense_gb_s`, what the cost model's `cpu_attention_q4_gib_s` means), and the host's memory
bandwidth (`host_copy_gb_s`: a torch copy of 1 GiB, bytes read + written) to compare them with. Writes one
record (common fields, one entry per kernel and dtype) to --out, default cpu_attention_speed_opt-30b.json
(the default shape, OPT-30B's heads), cpu_attention_speed_mixtral-8x7b.json with --shape mixtral-8x7b (a GPU
batch of 128 rows, 32 query / 8 kv heads, context 205: prompt 77 + 128 new), else
cpu_attention_speed_b<batch>-h<heads>-kv<kv_heads>-t<context>-d<head_dim>.json, in $OUT or benchmarks/results/.

    python benchmarks/cpu_attention_speed.py --out /tmp/cpu_attention.json      # OPT-30B-like shape
    python benchmarks/cpu_attention_speed.py --shape mixtral-8x7b                # issue 17's Mixtral shape
    python benchmarks/cpu_attention_speed.py --batch 2 --heads 4 --context 64 --repeats 2 --out /tmp/a.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/: bench_common
from bench_common import Timer, add_record_args, new_record, results_path, save_record  # noqa: E402

import torch  # noqa: E402

from engine.models.attention import CPU_CHUNK_BYTES, cpu_decode_attention, decode_attention  # noqa: E402
from engine.quant.config import CACHE_QUANT  # noqa: E402
from engine.quant.group import quantize  # noqa: E402

SHAPES = {"opt-30b": dict(batch=16, heads=56, kv_heads=56, context=544, head_dim=128),
          "mixtral-8x7b": dict(batch=128, heads=32, kv_heads=8, context=205, head_dim=128)}


def _time(fn, repeats: int) -> float:
    fn()
    with Timer() as t:
        for _ in range(repeats):
            fn()
    return t.seconds / repeats


def host_copy_gb_s(repeats: int) -> float:
    """The host's memory bandwidth as a torch copy of 1 GiB moves it: bytes read + written per second."""
    src = torch.ones(1 << 28)                                                # 1 GiB of float32
    dst = torch.empty_like(src)
    s = _time(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * src.element_size() / s / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="a named shape (overrides the sizes)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=56, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=None, help="kv heads (default: --heads)")
    ap.add_argument("--context", type=int, default=544)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--chunk-mib", default="8,16,64", help="dense MiB per chunk of the 4-bit cache, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    add_record_args(ap)
    args = ap.parse_args()
    sizes = SHAPES[args.shape] if args.shape else dict(batch=args.batch, heads=args.heads,
                                                         kv_heads=args.kv_heads or args.heads,
                                                         context=args.context, head_dim=args.head_dim)
    b, h, nkv, t, hd = (sizes[n] for n in ("batch", "heads", "kv_heads", "context", "head_dim"))
    named = next((name for name, shape in SHAPES.items() if shape == sizes), None)
    workload = named or f"b{b}-h{h}-kv{nkv}-t{t}-d{hd}"
    record = new_record("cpu_attention_speed", workload, None, device="cpu", commit=args.commit)
    g = torch.Generator().manual_seed(0)
    q32 = torch.randn(b, h, 1, hd, generator=g)
    k32 = torch.randn(b, nkv, t, hd, generator=g)
    v32 = torch.randn(b, nkv, t, hd, generator=g)
    valid = torch.ones(b, t, dtype=torch.bool)
    rows = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        q, k, v = q32.to(dtype), k32.to(dtype), v32.to(dtype)
        cache_bytes = 2 * k.numel() * k.element_size()
        s = _time(lambda: cpu_decode_attention(q, k, v, valid, 0.1), args.repeats)
        rows.append({"kernel": "engine", "dtype": str(dtype)[6:], "s": s, "gb_s": cache_bytes / s / 1e9,
                     "dense_gb_s": cache_bytes / s / 1e9})
        if dtype is not torch.float32:
            s = _time(lambda: decode_attention(q.float(), k.float(), v.float(), valid, 0.1), args.repeats)
            rows.append({"kernel": "fp32 upcast (FlexGen)", "dtype": str(dtype)[6:], "s": s,
                         "gb_s": cache_bytes / s / 1e9, "dense_gb_s": cache_bytes / s / 1e9})
    q = q32.to(torch.bfloat16)
    qk, qv = quantize(k32.to(torch.bfloat16), CACHE_QUANT), quantize(v32.to(torch.bfloat16), CACHE_QUANT)
    stored = sum(p.numel() * p.element_size() for x in (qk, qv) for p in x.parts())
    dense = 2 * k32.numel() * 2
    for mib in [int(m) for m in args.chunk_mib.split(",")]:
        s = _time(lambda: cpu_decode_attention(q, qk, qv, valid, 0.1, chunk_bytes=mib << 20), args.repeats)
        rows.append({"kernel": "engine 4-bit", "dtype": "bfloat16", "chunk_mib": mib,
                     "default_chunk": (mib << 20) == CPU_CHUNK_BYTES, "s": s, "gb_s": stored / s / 1e9,
                     "dense_gb_s": dense / s / 1e9})
    for r in rows:
        print(f"{r['kernel']:24s} {r['dtype']:9s} {str(r.get('chunk_mib', '')):>4s} {r['s'] * 1e3:8.2f} ms  "
              f"{r['gb_s']:6.2f} GB/s stored  {r['dense_gb_s']:6.2f} GB/s dense")
    copy_rate = host_copy_gb_s(args.repeats)
    print(f"host copy {copy_rate:.1f} GB/s (read + write)")
    record.update(shape={"batch": b, "heads": h, "kv_heads": nkv, "context": t, "head_dim": hd},
                  threads=torch.get_num_threads(), host_copy_gb_s=copy_rate, results=rows)
    save_record(args.out or results_path("cpu_attention_speed", workload), record, indent=1)


if __name__ == "__main__":
    main()
