"""Micro-benchmark: the prefill's elementwise work, torch ops against the fused Triton kernels.

Cases, on the Llama-3-70B prefill chunk's shapes (chunks of 4,096 tokens, hidden 8192, intermediate 28672,
8 kv heads of 128), float16 and bfloat16 each:
  rms_norm        x [4096, 8192]: `elementwise.rms_norm_torch` vs `elementwise.rms_norm` (the kernel on CUDA)
  silu_mul        gate, up [4096, 28672], the two halves of one [4096, 57344] projection: F.silu(gate) * up vs
                  `elementwise.silu_mul`
  quantize_k      a chunk's new keys [81, 8, 50, 128] (81 rows of 50 tokens, strided like the projection's
                  transposed view) with the cache's `CACHE_QUANT`: `group.quantize_torch` vs `group.quantize`
  quantize_decode one decode step's new keys [48, 56, 1, 128] (the same)
  rope_prefill    a chunk's queries [81, 64, 50, 128], the strided view of its [81, 50, 10240] q/k/v projection,
                  and cos/sin [81, 50, 128]: `elementwise.rope_torch` vs `elementwise.rope` (bit for bit)
  rope_decode     one decode step's queries [1536, 64, 1, 128] of a 1,536-row block (the same)
  decode_q4       one decode step's attention of a 2,304-row GPU batch (64 query heads over 8 kv heads) over the
                  wrangling shape's 150-token dense shared prefix and 60 positions of a `CACHE_QUANT` cache:
                  the chunked path (`attention.chunked_decode_attention` over dequantized chunks of rows) vs
                  `quant_decode.quantized_decode_attention` (the fused kernel on CUDA; elsewhere it declines
                  and the chunked path runs both); parity "within float rounding" at the kernel tests' ulps
Before timing, each case's kernel result is compared with the torch ops (recorded as `parity`: the ulp
rule of engine.models.elementwise.close_to_torch, `group.quantize_mismatch` for quantize). Times are medians
over --repeat runs (CUDA events; perf_counter on the CPU, where both paths are the torch ops), and `*_host_us`
the host's microseconds to issue one call (--repeat calls unsynced: a host-bound decode's cost); GB/s counts
the bytes the fused kernel reads and writes once. Appends one record (common fields, `triton`, one entry per
case and dtype) to benchmarks/records/<machine>/fused_kernels_speed.jsonl (or --out), workload
`llama-3-70b-prefill` (`--scale N`: the token and row counts divided by N, `llama-3-70b-prefill-div<N>`).

    python benchmarks/kernels/fused_kernels_speed.py --repeat 50                     # GPU
    python benchmarks/kernels/fused_kernels_speed.py --scale 32 --repeat 2 --out /tmp/fused.jsonl    # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import (Timer, add_record_args, median_ms, new_record, save_record,  # noqa: E402
                               torch_device)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.models.attention import chunked_decode_attention, dense_keys  # noqa: E402
from engine.models.elementwise import close_to_torch, rms_norm, rms_norm_torch, rope, rope_torch, silu_mul  # noqa: E402
from engine.models.quant_decode import quantized_decode_attention  # noqa: E402
from engine.quant.config import CACHE_QUANT  # noqa: E402
from engine.quant.group import quantize, quantize_mismatch, quantize_torch  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 8192, 28672, 64, 8, 128


def _ulp_parity(got: torch.Tensor, want: torch.Tensor) -> str:
    """"within 1 ulp" / "within 2 ulps" (close_to_torch) or "differs"."""
    for ulps in (1, 2):
        if close_to_torch(got, want, ulps=ulps):
            return f"within {ulps} ulp{'s' if ulps > 1 else ''}"
    return "differs"


def _cases(device: torch.device, dtype: torch.dtype, scale: int) -> dict[str, dict]:
    """{name: {shape, bytes, torch, fused, parity}}: thunks for both paths and the parity of their results."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    tokens, size = 4096 // scale, torch.finfo(dtype).bits // 8
    x, w = randn(tokens, HIDDEN), 1 + 0.1 * randn(HIDDEN)
    both = randn(tokens, 2 * INTERMEDIATE)                                    # [t, 2i]
    gate, up = both.chunk(2, dim=-1)                                          # 2 x [t, i] views
    k_chunk = randn(max(1, 81 // scale), 50, KV_HEADS, HEAD_DIM).transpose(1, 2)   # [b, nkv, s, hd] strided
    k_step = randn(max(1, 48 // scale), 56, 1, HEAD_DIM)                      # [b, 56, 1, hd]
    cases = {
        "rms_norm": dict(shape=list(x.shape), bytes=2 * x.numel() * size,
                         torch=lambda: rms_norm_torch(x, w, 1e-5), fused=lambda: rms_norm(x, w, 1e-5),
                         parity=_ulp_parity),
        "silu_mul": dict(shape=list(gate.shape), bytes=3 * gate.numel() * size,
                         torch=lambda: F.silu(gate) * up, fused=lambda: silu_mul(gate, up),
                         parity=_ulp_parity),
    }
    for name, k in (("quantize_k", k_chunk), ("quantize_decode", k_step)):
        packed = k.numel() // 2 + 2 * 2 * (k.numel() // CACHE_QUANT.group_size)    # codes + fp16 min/scale
        cases[name] = dict(shape=list(k.shape), bytes=k.numel() * size + packed,
                           torch=lambda k=k: quantize_torch(k, CACHE_QUANT), fused=lambda k=k: quantize(k, CACHE_QUANT),
                           parity=lambda a, b: quantize_mismatch(a, b) or "ok")
    for name, (rows, s) in (("rope_prefill", (81, 50)), ("rope_decode", (1536, 1))):
        rows = max(1, rows // scale)
        qkv = randn(rows, s, (HEADS + 2 * KV_HEADS) * HEAD_DIM)                # [b, s, (nh + 2 nkv) hd]
        q = qkv[..., :HEADS * HEAD_DIM].view(rows, s, HEADS, HEAD_DIM).transpose(1, 2)   # [b, nh, s, hd] strided
        cos, sin = randn(rows, s, HEAD_DIM), randn(rows, s, HEAD_DIM)
        cases[name] = dict(shape=list(q.shape), bytes=2 * q.numel() * size + 2 * cos.numel() * size,
                           torch=lambda q=q, c=cos, n=sin: rope_torch(q, c, n),
                           fused=lambda q=q, c=cos, n=sin: rope(q, c, n),
                           parity=lambda a, b: "bit for bit" if torch.equal(a, b) else "differs")
    cases["decode_q4"] = _decode_q4(randn, max(1, 2304 // scale), dtype)
    return cases


def _decode_q4(randn: Callable[..., torch.Tensor], rows: int, dtype: torch.dtype) -> dict:
    """The `decode_q4` case: `rows` rows of Llama-3-70B's decode attention over a 150-token prefix and 60 4-bit
    positions (`CACHE_QUANT`, in its stored basis when it rotates)."""
    prefix_len, written, size = 150, 60, torch.finfo(dtype).bits // 8
    rotation = CACHE_QUANT if CACHE_QUANT.rotate else None
    width = -(-HEAD_DIM // CACHE_QUANT.group_size) * CACHE_QUANT.group_size if rotation else HEAD_DIM
    q = randn(rows, HEADS, 1, HEAD_DIM)                                       # [b, nh, 1, hd]
    k = quantize(randn(rows, KV_HEADS, written, HEAD_DIM), CACHE_QUANT)         # [b, nkv, t, hd] 4-bit
    v = quantize(randn(rows, KV_HEADS, written, HEAD_DIM), CACHE_QUANT)
    pk, pv = randn(1, KV_HEADS, prefix_len, width), randn(1, KV_HEADS, prefix_len, width)   # [1, nkv, L, w]
    valid = torch.ones(rows, prefix_len + written, dtype=torch.bool, device=q.device)
    scale = HEAD_DIM ** -0.5

    def chunked() -> torch.Tensor:
        return chunked_decode_attention(q, lambda r0, r1: (dense_keys(k[r0:r1], written, rotation, pk),
                                                           dense_keys(v[r0:r1], written, rotation, pv)),
                                        valid, scale, 64, None, rotation)

    def fused() -> torch.Tensor:
        out = quantized_decode_attention(q, k, v, written, valid, scale, None, rotation, (pk, pv))
        return chunked() if out is None else out

    def parity(got: torch.Tensor, want: torch.Tensor) -> str:
        ulp = {torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
        err = (got.float() - want.float()).abs().max().item()
        return "within float rounding" if err <= ulp * want.float().abs().max().item() else "differs"

    cache = sum(p.numel() * p.element_size() for x in (k, v) for p in x.parts())
    return dict(shape=[rows, HEADS, KV_HEADS, prefix_len, written],
                bytes=cache + 2 * pk.numel() * size + 2 * q.numel() * size,
                torch=chunked, fused=fused, parity=parity)


def host_us(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Host microseconds to issue one fn() (`repeat` calls back to back, unsynced, then one sync): what a
    decode step whose host runs ahead of the device pays per call; on the CPU, the whole call."""
    with Timer() as t:
        for _ in range(repeat):
            fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return t.seconds / repeat * 1e6


def run(device: torch.device, dtype: torch.dtype, scale: int, repeat: int) -> dict[str, dict]:
    """Per case: shape, parity, torch_ms, fused_ms, their GB/s, their host microseconds a call, speedup."""
    results = {}
    for name, case in _cases(device, dtype, scale).items():
        torch_fn: Callable[[], object] = case["torch"]
        fused_fn: Callable[[], object] = case["fused"]
        row = {"shape": case["shape"], "parity": case["parity"](fused_fn(), torch_fn())}
        for variant, fn in (("torch", torch_fn), ("fused", fused_fn)):
            ms = median_ms(fn, device, repeat)
            row[f"{variant}_ms"] = round(ms, 4)
            row[f"{variant}_GBps"] = round(case["bytes"] / ms / 1e6, 1)
            row[f"{variant}_host_us"] = round(host_us(fn, device, repeat), 1)
        row["speedup"] = round(row["torch_ms"] / row["fused_ms"], 2)
        results[name] = row
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--scale", type=int, default=1, help="divide the token and row counts (quick CPU runs)")
    ap.add_argument("--dtype", action="append", choices=["float16", "bfloat16"], help="default: both")
    add_record_args(ap)
    args = ap.parse_args(argv)
    device = torch_device(args.device)
    workload = "llama-3-70b-prefill" if args.scale == 1 else f"llama-3-70b-prefill-div{args.scale}"
    try:
        import triton
        triton_version = triton.__version__ if device.type == "cuda" else None
    except ImportError:
        triton_version = None
    results = {name: run(device, getattr(torch, name), args.scale, args.repeat)
               for name in args.dtype or ["float16", "bfloat16"]}
    record = new_record("fused_kernels_speed", workload, "llama-3-70b", commit=args.commit,
                        device=None if device.type == "cuda" else "cpu")
    record.update(triton=triton_version, threads=torch.get_num_threads(), repeat=args.repeat, scale=args.scale,
                  cache_quant=CACHE_QUANT.tag, results=results)
    save_record(record, args.out)
    print(json.dumps(results, indent=2))
    return record


if __name__ == "__main__":
    main()
