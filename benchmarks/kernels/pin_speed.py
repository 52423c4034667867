"""How fast the process pins host memory, per pinning mode, and what pinning costs transfers running beside it.

    python benchmarks/kernels/pin_speed.py --gib 8        # CUDA only; appends to benchmarks/records/<machine>/pin_speed.jsonl

Modes (torch's pinned allocator, set at run time in this one process, in this order):
- `cudaHostAlloc`: torch's default (`pinned_use_cuda_host_register:False`), pages faulted in and locked on the
  calling thread;
- `register-N`: `pinned_use_cuda_host_register:True,pinned_num_register_threads:N` for N in --threads, pages
  faulted in on N threads and locked with cudaHostRegister (what `engine.storage.pinning.configure` sets).
Each mode pins --gib GiB as 1 GiB tensors (`torch.empty(..., pin_memory=True)`, the `HostPool` chunk) and
reports GB/s, then the host->device rate of a copy from one of them (`h2d_gib_s`, the mean of 5 1-GiB copies).
Between modes the tensors are dropped and torch's pinned cache emptied, so every mode pins fresh memory.
`beside`: the host->device rate of back-to-back 1 GiB copies from a pinned buffer on the main thread, alone and
while another thread pins --gib GiB in the last mode (`h2d_alone_gib_s`, `h2d_while_pinning_gib_s`).
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import GIB, add_record_args, empty_host_cache, new_record, save_record  # noqa: E402

import torch  # noqa: E402

from engine.storage.device_cap import allocator_setter  # noqa: E402


def _pin(count: int) -> tuple[list[torch.Tensor], float]:
    t0 = time.perf_counter()
    held = [torch.empty(GIB, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    return held, time.perf_counter() - t0


def _h2d(src: torch.Tensor, dst: torch.Tensor, reps: int) -> float:
    """GiB/s of `reps` back-to-back copies of `src` into `dst` (one stream, synchronized at the end)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return reps * src.numel() / GIB / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=8, help="GiB pinned per mode (1 GiB tensors)")
    ap.add_argument("--threads", default="1,4,8,16", help="register thread counts (powers of two)")
    add_record_args(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("pin_speed: needs CUDA", file=sys.stderr)
        return 2
    dst = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    modes = [("cudaHostAlloc", "pinned_use_cuda_host_register:False")]
    modes += [(f"register-{n}", f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{n}")
              for n in map(int, args.threads.split(","))]
    results = []
    for name, conf in modes:
        allocator_setter()(conf)
        held, seconds = _pin(args.gib)
        results.append({"mode": name, "settings": conf, "gib": args.gib, "seconds": round(seconds, 3),
                        "gb_s": round(args.gib * GIB / 1e9 / seconds, 2), "pinned": bool(held[0].is_pinned()),
                        "h2d_gib_s": round(_h2d(held[0], dst, 5), 1)})
        print(results[-1], flush=True)
        del held
        empty_host_cache()
    src = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    alone = _h2d(src, dst, 20)
    spent: list[float] = []
    worker = threading.Thread(target=lambda: spent.append(_pin(args.gib)[1]) or None)
    torch.cuda.synchronize()
    t0, copies = time.perf_counter(), 0
    worker.start()
    while worker.is_alive():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        copies += 1
    beside = copies / (time.perf_counter() - t0)
    worker.join()
    record = new_record("pin_speed", "pinning", None, commit=args.commit)
    record.update(modes=results, beside={"mode": modes[-1][0], "h2d_alone_gib_s": round(alone, 1),
                                         "h2d_while_pinning_gib_s": round(beside, 1),
                                         "pin_seconds_beside_copies": round(spent[0], 3) if spent else None})
    print(record["beside"], flush=True)
    save_record(record, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
