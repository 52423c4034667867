"""CPU decode attention rate: the engine's kernel per cache dtype (and 4-bit) against FlexGen's fp32 upcast.

One decode step's attention over a host KV cache (b rows, nkv kv heads, nh query heads, t positions, head_dim
hd), as the executor runs it when the cache lives on the cpu tier with cpu_attention: `cpu_decode_attention`
in fp16, bf16 (the C kernel of `engine.models.native_attention` where this CPU builds it; `torch SDPA` is the
same attention by torch's kernel) and fp32, over a 4-bit cache (`engine.quant`, dequantized per chunk of rows)
at several chunk sizes (--chunk-mib), and FlexGen's way (upcast the whole cache to fp32, then attend). The
4-bit cache is the engine's (`CACHE_QUANT`, Hadamard-rotated groups): `engine 4-bit` is the engine's path
(affine dequantization only, attention in the rotated basis), `4-bit unrotating (old)` the alternative (every
cached key and value row un-rotated by a matmul with H, then attention), same chunks. Reports seconds per
call (mean and best of --repeats), the cache bytes read per second as stored (`gb_s`; for 4-bit the packed bytes) and in dense bf16
equivalent (`dense_gb_s`, what the cost model's `cpu_attention_q4_gib_s` means; for 4-bit rows also
`ratio_to_bf16_dense`, the ratio `HardwareProfile.cpu_attention_q4_bytes_s` defaults to), and the host's memory
bandwidth (`host_copy_gb_s`: a torch copy of 1 GiB, bytes read + written) to compare them with. Appends one
record (common fields, one entry per kernel and dtype) to benchmarks/records/<machine>/cpu_attention_speed.jsonl
(or --out); its workload is `opt-30b` (the default shape, OPT-30B's heads), `mixtral-8x7b` with --shape
mixtral-8x7b (a GPU batch of 128 rows, 32 query / 8 kv heads, context 205: prompt 77 + 128 new),
`smollm2-135m` with --shape smollm2-135m (a CPU decode step of 64 rows: 9 query / 3 kv heads of 64, context
145, the longest sample prompt + 32 new), else
`b<batch>-h<heads>-kv<kv_heads>-t<context>-d<head_dim>`.

    python benchmarks/kernels/cpu_attention_speed.py --out /tmp/cpu_attention.jsonl     # OPT-30B-like shape
    python benchmarks/kernels/cpu_attention_speed.py --shape mixtral-8x7b                # Mixtral-8x7B's decode
    python benchmarks/kernels/cpu_attention_speed.py --shape smollm2-135m --chunk-mib 16  # the embedded model's
    python benchmarks/kernels/cpu_attention_speed.py --batch 2 --heads 4 --context 64 --repeats 2 --out /tmp/a.jsonl
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import Timer, add_record_args, new_record, save_record  # noqa: E402

import torch  # noqa: E402

from engine.models.attention import CPU_CHUNK_BYTES, cpu_decode_attention, decode_attention  # noqa: E402
from engine.quant.config import CACHE_QUANT  # noqa: E402
from engine.quant.group import dequantize, quantize  # noqa: E402
from engine.quant.qtensor import QTensor  # noqa: E402

SHAPES = {"opt-30b": dict(batch=16, heads=56, kv_heads=56, context=544, head_dim=128),
          "mixtral-8x7b": dict(batch=128, heads=32, kv_heads=8, context=205, head_dim=128),
          "smollm2-135m": dict(batch=64, heads=9, kv_heads=3, context=145, head_dim=64)}


def _time(fn, repeats: int) -> tuple[float, float]:
    """(mean, best) seconds per call over `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        with Timer() as t:
            fn()
        times.append(t.seconds)
    return sum(times) / repeats, min(times)


def _row(kernel: str, dtype: str, times: tuple[float, float], stored: int, dense: int, **extra) -> dict:
    """One result: seconds per call (mean `s`, `best_s`), and the cache bytes read per second as stored and
    dense-equivalent, from the mean and from the best call."""
    s, best = times
    return {"kernel": kernel, "dtype": dtype, **extra, "s": s, "best_s": best, "gb_s": stored / s / 1e9,
            "dense_gb_s": dense / s / 1e9, "best_gb_s": stored / best / 1e9, "best_dense_gb_s": dense / best / 1e9}


def torch_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention by torch's SDPA alone (the engine's path where no C kernel applies): q [b, nh, 1, hd]
    folded to [b, nkv, g, hd], k/v [b, nkv, t, hd], valid [b, t] -> [b, nkv, g, hd]."""
    b, nh, _, hd = q.shape
    qg = q.reshape(b, k.shape[1], nh // k.shape[1], hd)
    return torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=valid[:, None, None, :], scale=scale)


def unrotating_attention(q: torch.Tensor, k: QTensor, v: QTensor, valid: torch.Tensor, scale: float,
                         chunk_bytes: int) -> torch.Tensor:
    """The un-rotating host path over a rotated 4-bit cache, for comparison: per chunk of rows (as
    `cpu_decode_attention` cuts them), dequantize with every row un-rotated, then `decode_attention`."""
    b, _, _, hd = q.shape
    rows = max(1, min(b, chunk_bytes // (2 * k.shape[1] * k.shape[2] * hd * q.element_size())))
    out = torch.empty_like(q)                                                # [b, nh, 1, hd]
    for r0 in range(0, b, rows):
        r1 = min(b, r0 + rows)
        out[r0:r1] = decode_attention(q[r0:r1], dequantize(k[r0:r1]), dequantize(v[r0:r1]), valid[r0:r1], scale)
    return out


def host_copy_gb_s(repeats: int) -> float:
    """The host's memory bandwidth as a torch copy of 1 GiB moves it: bytes read + written per second."""
    src = torch.ones(1 << 28)                                                # 1 GiB of float32
    dst = torch.empty_like(src)
    s = _time(lambda: dst.copy_(src), repeats)[0]
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
        times = _time(lambda: cpu_decode_attention(q, k, v, valid, 0.1), args.repeats)
        rows.append(_row("engine", str(dtype)[6:], times, cache_bytes, cache_bytes))
        if dtype is torch.bfloat16:
            times = _time(lambda: torch_sdpa(q, k, v, valid, 0.1), args.repeats)
            rows.append(_row("torch SDPA", "bfloat16", times, cache_bytes, cache_bytes))
        if dtype is not torch.float32:
            times = _time(lambda: decode_attention(q.float(), k.float(), v.float(), valid, 0.1), args.repeats)
            rows.append(_row("fp32 upcast (FlexGen)", str(dtype)[6:], times, cache_bytes, cache_bytes))
    bf16 = next(r for r in rows if r["kernel"] == "engine" and r["dtype"] == "bfloat16")
    q = q32.to(torch.bfloat16)
    qk, qv = quantize(k32.to(torch.bfloat16), CACHE_QUANT), quantize(v32.to(torch.bfloat16), CACHE_QUANT)
    stored = sum(p.numel() * p.element_size() for x in (qk, qv) for p in x.parts())
    dense = 2 * k32.numel() * 2
    for mib in [int(m) for m in args.chunk_mib.split(",")]:
        for kernel, fn in (("engine 4-bit", cpu_decode_attention), ("4-bit unrotating (old)", unrotating_attention)):
            times = _time(lambda: fn(q, qk, qv, valid, 0.1, chunk_bytes=mib << 20), args.repeats)
            row = _row(kernel, "bfloat16", times, stored, dense, chunk_mib=mib,
                       default_chunk=(mib << 20) == CPU_CHUNK_BYTES)
            row["ratio_to_bf16_dense"] = row["dense_gb_s"] / bf16["dense_gb_s"]    # the cost model's q4 ratio
            rows.append(row)
    for r in rows:
        print(f"{r['kernel']:24s} {r['dtype']:9s} {str(r.get('chunk_mib', '')):>4s} {r['s'] * 1e3:8.2f} ms "
              f"(best {r['best_s'] * 1e3:8.2f})  {r['gb_s']:6.2f} GB/s stored  {r['dense_gb_s']:6.2f} GB/s dense "
              f"(best {r['best_dense_gb_s']:6.2f})" + (f"  {r['ratio_to_bf16_dense']:.3f} x bf16 dense"
                                                       if "ratio_to_bf16_dense" in r else ""))
    copy_rate = host_copy_gb_s(args.repeats)
    print(f"host copy {copy_rate:.1f} GB/s (read + write)")
    record.update(shape={"batch": b, "heads": h, "kv_heads": nkv, "context": t, "head_dim": hd},
                  threads=torch.get_num_threads(), host_copy_gb_s=copy_rate, results=rows)
    save_record(record, args.out)


if __name__ == "__main__":
    main()
