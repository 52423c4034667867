"""Where device memory peaks inside the block schedule: torch's allocator peak per schedule action.

Runs one dummy preset under one policy (a warm-up block, then a measured block, as gpu_offload.py does) and
prints, per (verb, phase, layer kind, GPU batch), the highest `torch.cuda.max_memory_allocated` seen while
that action ran, next to the executor's own accounting. Used to find allocations the budget does not count.

    python benchmarks/gpu_memory_trace.py --model opt-6.7b --policy '{"gpu_batch_size": 16, "num_gpu_batches": 2,
        "w_gpu": 0, "w_cpu": 1}' --gen-len 8
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.models.loader import load_model  # noqa: E402
from engine.policy.policy import Policy  # noqa: E402
from engine.runtime.executor import Executor  # noqa: E402
from engine.sizes import parse_size  # noqa: E402

GIB = 2 ** 30


class _Greedy:
    def __call__(self, rows, logits):
        return logits.argmax(-1).tolist(), [False] * len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-6.7b")
    ap.add_argument("--policy", required=True, help="a Policy as JSON")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--gpu-memory", default="16GiB")
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=torch.float16)
    policy = Policy.from_dict(json.loads(args.policy))
    ex = Executor(loaded, policy, device=torch.device("cuda"), dtype=torch.float16,
                  gpu_memory=parse_size(args.gpu_memory))
    specs = loaded.family.layer_specs()
    n = policy.block_size
    prompts = torch.randint(10, loaded.config.vocab_size - 1, (n, args.prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()
    for label, gen in (("warm-up", 1), ("measured", args.gen_len)):
        peaks: dict[tuple, int] = defaultdict(int)
        last = {"action": None}

        def hook(action, peaks=peaks, last=last):
            torch.cuda.synchronize()
            a = last["action"]
            if a is not None:
                key = (a.verb, "prefill" if a.i == 0 else "decode", specs[a.j].kind, a.k)
                peaks[key] = max(peaks[key], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            last["action"] = action

        ex.on_action = hook
        torch.cuda.reset_peak_memory_stats()
        ex.generate_block(prompts, [gen] * n, _Greedy())
        print(f"== {label} block: executor {json.dumps(ex.memory_report()['gpu'])}, "
              f"allocated after {torch.cuda.memory_allocated() / GIB:.2f} GiB")
        for key, value in sorted(peaks.items(), key=lambda kv: -kv[1])[:10]:
            print(f"   {value / GIB:6.2f} GiB  {key}")
    ex.close()


if __name__ == "__main__":
    main()
