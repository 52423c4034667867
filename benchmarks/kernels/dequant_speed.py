"""Micro-benchmark: the original 4-bit dequantize (unpack, stack, addcmul, cast, copy) against
`engine.quant.kernels.affine_dequant` (one Triton kernel on CUDA, the in-place torch path elsewhere).

Cases, on OPT-6.7B shapes in float16:
  weight         [16384, 4096] into a preallocated buffer (`WeightHomes.get`)
  kv_full        [64, 32, 544, 128], a whole compressed cache, fresh result
  kv_gpu_home    the first 544 of 576 positions of a compressed cache (strided slice; `KVHome.decode`, gpu home)
  kv_decode_cat  a loaded compressed cache of t = 544 positions plus the new token: old = dequantize then
                 torch.cat, new = dequantize into a buffer of t + 1 positions and write the token in place
Times are medians over --repeat runs (CUDA events on a GPU, perf_counter on the CPU); GB/s counts the packed
bytes read plus the dense bytes written once. Appends one record (common fields, one entry per case) to
benchmarks/records/<machine>/dequant_speed.jsonl (or --out), workload `opt-6.7b` (`--scale N`: `opt-6.7b-div<N>`).

    python benchmarks/kernels/dequant_speed.py --repeat 50                          # GPU
    python benchmarks/kernels/dequant_speed.py --out /tmp/dequant_speed_cpu.jsonl --repeat 3 [--scale 8]   # CPU
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import add_record_args, median_ms, new_record, save_record, torch_device  # noqa: E402
from engine.quant import QuantConfig, quantize  # noqa: E402
from engine.quant.kernels import affine_dequant, affine_dequant_torch  # noqa: E402
from engine.quant.qtensor import QTensor  # noqa: E402


def old_dequantize(q: QTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dequantize of engine/quant/group.py before the fused kernel (the baseline)."""
    *lead, d = q.shape
    low = q.data & 0x0F                                                    # [*lead, g, gs/2]
    high = q.data >> 4
    codes = torch.stack((low, high), dim=-1).flatten(-2)                   # [*lead, g, gs]
    dense = torch.addcmul(q.mn, codes.to(q.mn.dtype), q.scale).to(q.dtype)  # [*lead, g, gs]
    dense = dense.flatten(-2)[..., :d]                                     # [*lead, d]
    if out is None:
        return dense
    return out.copy_(dense)


def new_dequantize(q: QTensor, out: torch.Tensor | None = None, fn: Callable = affine_dequant) -> torch.Tensor:
    """dequantize as proposed for engine/quant/group.py (fn: affine_dequant, or its torch path)."""
    *lead, d = q.shape
    direct = out if out is not None and d == 2 * q.data.shape[-2] * q.data.shape[-1] else None
    dense = fn(q.data, q.mn, q.scale, q.dtype, out=direct).flatten(-2)[..., :d]   # [*lead, d]
    if out is None or direct is not None:
        return dense if out is None else out
    return out.copy_(dense)


def _qtensor(shape: tuple[int, ...], device: torch.device) -> QTensor:
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float16, device=device)
    return quantize(x, QuantConfig())


def _cases(device: torch.device, scale: int) -> tuple[dict[str, dict[str, Callable[[], object]]], dict]:
    """({name: {variant: thunk}}, {name: shape}). `scale` divides the batch dims (1 = the real OPT-6.7B shapes)."""
    w = _qtensor((16384 // scale, 4096), device)
    w_out = torch.empty(tuple(w.shape), dtype=torch.float16, device=device)
    b, h, t, hd = 64 // scale, 32, 544, 128
    kv = _qtensor((b, h, t, hd), device)
    home = _qtensor((b, h, t + 32, hd), device)
    new_tok = torch.randn(b, h, 1, hd, dtype=torch.float16, device=device)

    def cat_old():
        return torch.cat((old_dequantize(kv), new_tok), dim=2)                 # [b, h, t+1, hd]

    def cat_new(fn=affine_dequant):
        buf = torch.empty(b, h, t + 1, hd, dtype=torch.float16, device=device)  # [b, h, t+1, hd]
        new_dequantize(kv, out=buf[:, :, :t], fn=fn)
        buf[:, :, t:].copy_(new_tok)
        return buf

    cases = {
        "weight": {"old": lambda: old_dequantize(w, out=w_out), "new": lambda: new_dequantize(w, out=w_out),
                   "new_torch": lambda: new_dequantize(w, out=w_out, fn=affine_dequant_torch)},
        "kv_full": {"old": lambda: old_dequantize(kv), "new": lambda: new_dequantize(kv),
                    "new_torch": lambda: new_dequantize(kv, fn=affine_dequant_torch)},
        "kv_gpu_home": {"old": lambda: old_dequantize(home[:, :, :t]), "new": lambda: new_dequantize(home[:, :, :t]),
                        "new_torch": lambda: new_dequantize(home[:, :, :t], fn=affine_dequant_torch)},
        "kv_decode_cat": {"old": cat_old, "new": cat_new, "new_torch": lambda: cat_new(affine_dequant_torch)},
    }
    shapes = {"weight": tuple(w.shape), "kv_full": tuple(kv.shape), "kv_gpu_home": (b, h, t, hd),
              "kv_decode_cat": (b, h, t + 1, hd)}
    return cases, shapes


def _check(cases: dict) -> None:
    """Every variant of a case returns the same values as the baseline (bit for bit)."""
    for name, variants in cases.items():
        ref = variants["old"]().clone()
        for variant, fn in variants.items():
            if not torch.equal(fn(), ref):
                raise AssertionError(f"dequant_speed: {name}/{variant} differs from the old dequantize")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--scale", type=int, default=1, help="divide the batch dims (quick CPU runs)")
    add_record_args(ap)
    args = ap.parse_args()
    device = torch_device(args.device)
    workload = "opt-6.7b" if args.scale == 1 else f"opt-6.7b-div{args.scale}"
    cases, shapes = _cases(device, args.scale)
    _check(cases)
    try:
        import triton
        triton_version = triton.__version__ if device.type == "cuda" else None
    except ImportError:
        triton_version = None
    results = {}
    for name, variants in cases.items():
        n = 1
        for x in shapes[name]:
            n *= x
        moved = n * 2 + n // 2 + 4 * (n // 64)        # dense fp16 written, packed codes and fp16 min/scale read
        row = {"shape": list(shapes[name])}
        for variant, fn in variants.items():
            ms = median_ms(fn, device, args.repeat)
            row[f"{variant}_ms"] = round(ms, 4)
            row[f"{variant}_GBps"] = round(moved / ms / 1e6, 1)
        row["speedup"] = round(row["old_ms"] / row["new_ms"], 2)
        results[name] = row
    record = new_record("dequant_speed", workload, None, commit=args.commit,
                        device=None if device.type == "cuda" else "cpu")
    record.update(triton=triton_version, threads=torch.get_num_threads(), repeat=args.repeat, scale=args.scale,
                  dtype="float16", results=results)
    save_record(record, args.out)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
