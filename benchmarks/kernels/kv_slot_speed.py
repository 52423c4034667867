"""One decode slot of one attention layer's KV cache, timed part by part: where an offloaded cache's time goes.

The executor's decode slot for (layer j, GPU batch k) over a `KVHome` is: `load` (a cpu home copied into a
device buffer), `decode` (the new k/v joined, attention over [0, t]), `store` (the new position back to the
home, on the store stream and the finisher thread). This harness builds one home of the shape asked (4-bit,
the engine's rotated `CACHE_QUANT`, or dense), fills positions [0, t) and times --repeats slots per home
placement (`gpu`: the cache on the device, attention in place; `cpu`: on the host, loaded per slot; `split`:
half the kv heads each), with a device sync around each part, so the parts are serial here (the executor
overlaps load and store with the neighbouring slots' compute). With --trace, also torch.profiler's table of
the top ops by device time and by host time for the `cpu` placement, so a slot's host-side launch cost shows.
Writes one record (common fields; per placement: load_s, decode_s, store_s, slot_s as means, decode_host_s
(the host's seconds to issue the decode: what a host-bound decode step pays), the home's bytes and the load's
GB/s), workload the shape, to benchmarks/records/<machine>/kv_slot_speed.jsonl (or --out).

    python benchmarks/kernels/kv_slot_speed.py --shape opt-30b --trace       # OPT-30B 48 rows, context 544
    python benchmarks/kernels/kv_slot_speed.py --shape mixtral-8x7b          # 128 rows, 8 kv heads, context 205
    python benchmarks/kernels/kv_slot_speed.py --shape llama-3-70b-wrangle   # 1,536 rows, a 150-position shared prefix
    python benchmarks/kernels/kv_slot_speed.py --rows 2 --heads 4 --kv-heads 2 --context 16 --repeats 2 --out /tmp/k.jsonl
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import add_record_args, new_record, save_record, torch_device  # noqa: E402

import torch  # noqa: E402

from engine.quant.config import CACHE_QUANT  # noqa: E402
from engine.runtime.arena import Arena  # noqa: E402
from engine.runtime.kv_buffers import StagingClaims  # noqa: E402
from engine.runtime.kv_cache import KVHome  # noqa: E402
from engine.runtime.transfers import Transfers  # noqa: E402
from engine.storage.tiers import MemoryBudget, Tier, stored_nbytes  # noqa: E402

SHAPES = {"opt-30b": dict(rows=48, heads=56, kv_heads=56, context=544, head_dim=128),
          "mixtral-8x7b": dict(rows=128, heads=32, kv_heads=8, context=205, head_dim=128),
          # the wrangle workload's last decode step: 1,536 rows, 150 shared + 50 own + 9 new positions
          "llama-3-70b-wrangle": dict(rows=1536, heads=64, kv_heads=8, context=210, head_dim=128, prefix=150)}
PLACEMENTS = {"gpu": (1.0, 0.0), "cpu": (0.0, 1.0), "split": (0.5, 0.5)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_placement(name: str, args, device: torch.device, dtype: torch.dtype, trace: bool) -> dict:
    """Mean seconds of each part of --repeats decode slots over one home placed as `name`."""
    cache_gpu, cache_cpu = PLACEMENTS[name]
    arena = Arena(device, MemoryBudget({t: None for t in Tier}), None)
    transfers, claims = Transfers(device, overlap=True), StagingClaims()
    b, nh, nkv, hd, t = args.rows, args.heads, args.kv_heads, args.head_dim, args.context - 1
    home = KVHome(arena, "kv", rows=b, length=args.context, num_kv_heads=nkv, head_dim=hd, dtype=dtype,
                  cache_gpu=cache_gpu, cache_cpu=cache_cpu, quant=None if args.dense else CACHE_QUANT,
                  cpu_attention=False, prefix_len=args.prefix)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, nh, t, hd, generator=g, device=device, dtype=dtype)         # [b, nh, t, hd]
    k = torch.randn(b, nkv, t, hd, generator=g, device=device, dtype=dtype)        # [b, nkv, t, hd]
    v = torch.randn(b, nkv, t, hd, generator=g, device=device, dtype=dtype)
    mask = torch.ones(b, 1, t, t, dtype=torch.bool, device=device).tril()         # [b, 1, t, t]
    home.prefill(q[:, :, :8], k, v, mask[:, :, :8], hd ** -0.5)
    home.store(transfers, 0, claims)
    home.settle()
    qn = torch.randn(b, nh, 1, hd, generator=g, device=device, dtype=dtype)        # [b, nh, 1, hd]
    kn = torch.randn(b, nkv, 1, hd, generator=g, device=device, dtype=dtype)       # [b, nkv, 1, hd]
    valid = torch.ones(b, t + 1, dtype=torch.bool, device=device)                   # [b, t+1]
    valid_host = valid.cpu()
    parts = {"load_s": 0.0, "decode_s": 0.0, "store_s": 0.0}
    issued = [0.0]                                                                    # decode's host seconds

    def slot(timed: bool) -> None:
        marks = [time.perf_counter()]
        for pending in home.load(transfers, 0):
            pending.wait()
        _sync(device)
        marks.append(time.perf_counter())
        home.decode(qn, kn, kn, t, valid, valid_host, hd ** -0.5)
        launched = time.perf_counter()
        _sync(device)
        marks.append(time.perf_counter())
        home.store(transfers, 0, claims)
        home.settle()
        _sync(device)
        marks.append(time.perf_counter())
        if timed:
            for key, a, z in zip(parts, marks, marks[1:]):
                parts[key] += z - a
            issued[0] += launched - marks[1]

    slot(False)                                                                       # warm-up
    for _ in range(args.repeats):
        slot(True)
    out = {key: value / args.repeats for key, value in parts.items()}
    out["slot_s"] = sum(out.values())
    out["decode_host_s"] = issued[0] / args.repeats      # issuing the decode (its launches), before its sync
    off = [s for s in home.segments if s.tier is not Tier.GPU]
    moved = sum(stored_nbytes(x) for s in off for x in (s.k, s.v))
    out.update(home_bytes_loaded=moved, load_gb_s=moved / out["load_s"] / 1e9 if moved and out["load_s"] else None)
    if trace and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                slot(False)
        averages = prof.key_averages()
        out["trace_by_device_time"] = averages.table(sort_by="cuda_time_total", row_limit=15)
        out["trace_by_host_time"] = averages.table(sort_by="self_cpu_time_total", row_limit=15)
    transfers.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="a named shape (overrides the sizes)")
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--kv-heads", type=int, default=56)
    ap.add_argument("--context", type=int, default=544, help="cache length (the slot attends over all of it)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prefix", type=int, default=0,
                    help="shared prefix positions held once (KVHome.prefix_len)")
    ap.add_argument("--dense", action="store_true", help="a dense cache instead of the 4-bit one")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--placement", action="append", choices=sorted(PLACEMENTS), help="default: all three")
    ap.add_argument("--trace", action="store_true", help="torch.profiler tables for the cpu placement (CUDA)")
    add_record_args(ap)
    args = ap.parse_args(argv)
    for key, value in SHAPES.get(args.shape, {}).items():
        setattr(args, key, value)
    device = torch_device()
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    workload = args.shape or f"b{args.rows}-h{args.heads}-kv{args.kv_heads}-t{args.context}-d{args.head_dim}"
    rec = new_record("kv_slot_speed", workload, args.shape, commit=args.commit)
    rec.update(rows=args.rows, heads=args.heads, kv_heads=args.kv_heads, context=args.context,
               head_dim=args.head_dim, prefix=args.prefix, cache="dense" if args.dense else "4-bit rotated", repeats=args.repeats,
               placements={name: run_placement(name, args, device, dtype, args.trace and name == "cpu")
                           for name in args.placement or PLACEMENTS})
    save_record(rec, args.out)
    return rec


if __name__ == "__main__":
    main()
