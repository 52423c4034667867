"""The executor's own host cost: Python calls and CPU seconds per block on a tiny, deep model.

A 32-layer copy of the `tiny-opt` preset (hidden 64, dummy weights) on the CPU, so the torch ops are cheap and
the executor's bookkeeping shows: per GPU-batch count (1 and 2 batches of 4 rows, 16-token prompts, 16 new
tokens), the Python function calls of one block (cProfile, deterministic) and the median CPU time
(`time.process_time`, one thread) of `--repeats` blocks. Appends one record (common fields, one entry per
GPU-batch count) to benchmarks/records/<machine>/executor_overhead.jsonl (or --out). CPU.

    python benchmarks/kernels/executor_overhead.py [--layers 32] [--repeats 15] [--out /tmp/executor_overhead.jsonl]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import add_record_args, new_record, save_record  # noqa: E402

import torch  # noqa: E402

from engine.models.hf_config import config_from_hf  # noqa: E402
from engine.models.presets import PRESETS  # noqa: E402
from engine.policy.policy import Policy  # noqa: E402
from engine.calibrate.trial import truncated_model  # noqa: E402
from engine.runtime.executor import Executor  # noqa: E402
from engine.runtime.selector import GreedyToEnd  # noqa: E402

BENCHMARK, WORKLOAD = "executor_overhead", "tiny-opt-deep"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    add_record_args(ap)
    args = ap.parse_args()
    record = new_record(BENCHMARK, WORKLOAD, "tiny-opt", device="cpu", commit=args.commit)
    torch.set_num_threads(1)
    loaded = truncated_model(config_from_hf(PRESETS["tiny-opt"]), args.layers, torch.float32, name="overhead")
    results = []
    for batches in (1, 2):
        ex = Executor(loaded, Policy(gpu_batch_size=4, num_gpu_batches=batches), device=torch.device("cpu"),
                      dtype=torch.float32)
        prompts = [[5] * 16 for _ in range(4 * batches)]
        ex.generate_block(prompts, [2] * len(prompts), GreedyToEnd())
        profiler = cProfile.Profile()
        profiler.enable()
        ex.generate_block(prompts, [16] * len(prompts), GreedyToEnd())
        profiler.disable()
        seconds = []
        for _ in range(args.repeats):
            t0 = time.process_time()
            ex.generate_block(prompts, [16] * len(prompts), GreedyToEnd())
            seconds.append(time.process_time() - t0)
        ex.close()
        results.append({"gpu_batches": batches, "python_calls": pstats.Stats(profiler).total_calls,
                        "cpu_s_median": statistics.median(seconds), "cpu_s_min": min(seconds)})
        print(json.dumps(results[-1]))
    record.update(layers=args.layers, repeats=args.repeats, results=results)
    save_record(record, args.out)


if __name__ == "__main__":
    main()
