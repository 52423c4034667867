"""Host->device rate of the copies a decode step makes: whole weight tensors, and a 4-bit KV home's written
positions as `engine.storage.copy` issues them (one pitched copy per part: codes, mins, scales).

    python benchmarks/kernels/link_speed.py        # CUDA only; appends to benchmarks/records/<machine>/link_speed.jsonl

A KV home [rows, heads, S, hd] in groups of `group` is three tensors, each [rows, heads, S, ...] whose rows of
runs are the written positions: the codes n x group/2 bytes a group, the mins and scales n x 2 bytes a group.
Each is measured in both layouts `engine.runtime.kv_cache` holds a home in: head-major (memory [rows, heads,
S, ...], a run per row and head) and positions-major (memory [rows, S, heads, ...], a run per row, `heads`
times longer; a loaded 4-bit home's layout). Per part and layout the record gives the pitched copy of n
positions (what a decode step moves) and the contiguous copy of the whole part (S positions), each as GiB/s of
the bytes it moves and ms; and the weights' rate for back-to-back copies of one `--weight-mib` tensor.
Defaults: Mixtral-8x7B's cache at 1024x2 (one GPU batch of 1,024 rows, 8 kv heads, head dim 128, 77 + 128 - 1
positions, 141 written: the decode's mean), groups of 64.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import GIB, add_record_args, new_record, save_record  # noqa: E402

import torch  # noqa: E402

from engine.quant.config import QuantConfig  # noqa: E402
from engine.quant.qtensor import empty_qtensor  # noqa: E402
from engine.storage.pitched import pitched_available, prefix_copy  # noqa: E402


def _ms(fn, reps: int) -> float:
    """Mean milliseconds of `fn()` over `reps` back-to-back calls on one stream (synchronized at both ends)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--positions", type=int, default=204, help="S: the home's positions")
    ap.add_argument("--written", type=int, default=141, help="n: the positions a step moves")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--weight-mib", type=int, default=252)
    ap.add_argument("--reps", type=int, default=20)
    add_record_args(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("link_speed: needs a CUDA device", file=sys.stderr)
        return 2
    stream = torch.cuda.current_stream()
    weight = torch.empty(args.weight_mib << 20, dtype=torch.uint8, pin_memory=True)
    weight_dev = torch.empty_like(weight, device="cuda")
    weight_ms = _ms(lambda: weight_dev.copy_(weight, non_blocking=True), args.reps)
    shape = (args.rows, args.heads, args.positions, args.head_dim)
    quant = QuantConfig(bits=4, group_size=args.group)
    parts = []
    for layout in ("heads", "positions"):
        held = shape if layout == "heads" else (args.rows, args.positions, args.heads, args.head_dim)
        home = empty_qtensor(held, torch.bfloat16, quant, pin_memory=True)
        buf = empty_qtensor(held, torch.bfloat16, quant, device="cuda")
        if layout == "positions":
            home, buf = home.transpose(1, 2), buf.transpose(1, 2)        # seen as [rows, heads, S, ...]
        runs = args.rows * (args.heads if layout == "heads" else 1)
        for name, src, dst in zip(("codes", "mins", "scales"), home.parts(), buf.parts()):
            src.zero_()
            moved = src[:, :, :args.written].numel() * src.element_size()
            whole = src.numel() * src.element_size()
            pitched_ms = _ms(lambda d=dst, s=src: prefix_copy(d, s, args.written, 2, stream), args.reps)
            whole_ms = _ms(lambda d=dst, s=src: d.copy_(s, non_blocking=True), args.reps)
            parts.append({"layout": layout, "part": name, "run_bytes": moved // runs, "pitched_bytes": moved,
                          "pitched_ms": pitched_ms, "pitched_gib_s": moved / GIB / pitched_ms * 1e3,
                          "whole_bytes": whole, "whole_ms": whole_ms, "whole_gib_s": whole / GIB / whole_ms * 1e3})
    record = new_record("link_speed", "kv-home", None, commit=args.commit)
    record.update(pitched=pitched_available(), shape=list(shape), written=args.written, group=args.group,
                  weight_bytes=weight.numel(), weight_ms=weight_ms,
                  weight_gib_s=weight.numel() / GIB / weight_ms * 1e3, parts=parts)
    path = save_record(record, args.out)
    print(f"weights {record['weight_gib_s']:.1f} GiB/s; " + "; ".join(
        f"{p['layout']}-major {p['part']} run {p['run_bytes']} B pitched {p['pitched_gib_s']:.1f} GiB/s "
        f"{p['pitched_ms']:.3f} ms, whole {p['whole_gib_s']:.1f} GiB/s {p['whole_ms']:.3f} ms" for p in parts)
        + f" -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
