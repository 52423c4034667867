"""Does the device stay within the memory model's budget? The buffer-plan grid on CUDA, as a record.

Runs every case of the CUDA buffer-plan grid (`tests/helpers/buffer_plans.py`: `GRID`, each policy with its
shared prefix and block count, on a small fp16 model of each family in `CUDA_KINDS`), each with its GPU budget
set to the memory model's gpu peak for that case, and records per case: the buffers allocated unlike the plan
(`differences`, expected empty), whether the executor's memory report equals the memory model's, the budget and
torch's device peak (bytes above what was allocated before the case) and `within_budget`. One record (common
fields; peak_device_gib the largest case peak, `all_within_budget`, `cases`) appended to
benchmarks/records/<machine>/plan_peaks.jsonl (or --out). CUDA only; the same grid is the assertion of
tests/gpu/test_gpu_buffer_plan.py.

    python benchmarks/policy/plan_peaks.py
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))                      # the repository root
sys.path.insert(0, str(ROOT / "tests"))            # the grid and its runner (tests/helpers)
from benchmarks.common import GIB, add_record_args, new_record, save_record  # noqa: E402

import torch  # noqa: E402

from helpers.buffer_plans import CUDA_KINDS, GRID, cuda_case  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_record_args(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("plan_peaks needs a CUDA device")
    cases = []
    for name in sorted(CUDA_KINDS):
        for case in sorted(GRID):
            with tempfile.TemporaryDirectory() as disk:
                got = cuda_case(name, case, Path(disk))
            cases.append(got)
            print(f"{name:9s} {case:20s} peak {got['device_peak_bytes'] / 2**20:8.1f} MiB of "
                  f"{got['budget_bytes'] / 2**20:8.1f}  {'ok' if got['within_budget'] else 'OVER'}"
                  f"{'' if not got['differences'] else '  differences: ' + '; '.join(got['differences'])}")
    record = new_record("plan_peaks", "buffer-plan grid", "+".join(sorted(CUDA_KINDS)))
    record["peak_device_gib"] = round(max(c["device_peak_bytes"] for c in cases) / GIB, 4)
    record["all_within_budget"] = all(c["within_budget"] for c in cases)
    record["all_as_planned"] = all(not c["differences"] and c["report_matches"] for c in cases)
    record["cases"] = cases
    save_record(record, args.out)
    return 0 if record["all_within_budget"] and record["all_as_planned"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
