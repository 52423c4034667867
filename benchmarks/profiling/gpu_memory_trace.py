"""Where device memory peaks inside the block schedule, and which allocations hold it.

Runs one dummy preset under one policy (a warm-up block, then a measured block, as throughput/throughput.py does).
Per schedule action it records the allocator's bytes in use: `--sync` synchronizes before each reading
(device-side truth per action), the default does not (the host may run ahead, as in a real run). With
`--snapshot`, allocation history with Python stacks is recorded and, each time usage climbs past the highest
so far by 256 MiB, the live blocks are summarized by state (active / pending free after a cross-stream use)
and by the innermost engine frame that allocated them. Prints the summary and writes it as one record
(common fields; peak_device_gib the measured block's) appended to
benchmarks/records/<machine>/gpu_memory_trace.jsonl (or --out). GPU only.

    python benchmarks/profiling/gpu_memory_trace.py --model opt-6.7b --policy '{"gpu_batch_size": 16, "num_gpu_batches": 2,
        "w_gpu": 0, "w_cpu": 1}' --gen-len 4 --snapshot --out /tmp/trace.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import GIB, add_record_args, new_record, save_record  # noqa: E402

import torch  # noqa: E402

from engine.models.loader import load_model  # noqa: E402
from engine.policy.policy import Policy  # noqa: E402
from engine.runtime.executor import Executor  # noqa: E402
from engine.runtime.selector import GreedyToEnd  # noqa: E402
from engine.util.sizes import parse_size  # noqa: E402

_STEP = 256 << 20


def _site(frames: list[dict]) -> str:
    """The innermost frame inside this repository's engine/ or benchmarks/ code."""
    for f in frames:
        name = f.get("filename", "")
        if "/engine/" in name or "/benchmarks/" in name:
            return f"{name.split('/engine/')[-1] if '/engine/' in name else Path(name).name}:{f.get('line')}"
    return "other"


def summarize_snapshot() -> dict:
    """Live device blocks grouped by (state, allocation site): bytes, largest first."""
    groups: dict[tuple[str, str], int] = defaultdict(int)
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for block in seg["blocks"]:
            if block["state"] == "inactive":
                continue
            groups[(block["state"], _site(block.get("frames", [])))] += block["size"]
    top = sorted(groups.items(), key=lambda kv: -kv[1])[:25]
    return {"allocated_gib": torch.cuda.memory_allocated() / GIB,
            "blocks": [{"state": s, "site": site, "gib": n / GIB} for (s, site), n in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-6.7b")
    ap.add_argument("--policy", required=True, help="a Policy as JSON")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--gpu-memory", default="16GiB")
    ap.add_argument("--sync", action="store_true", help="synchronize before each reading")
    ap.add_argument("--snapshot", action="store_true", help="summarize live blocks at each new peak")
    add_record_args(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_memory_trace.py traces the CUDA allocator: it needs a GPU")
    loaded = load_model(args.model, dtype=torch.float16)
    policy = Policy.from_dict(json.loads(args.policy))
    ex = Executor(loaded, policy, device=torch.device("cuda"), dtype=torch.float16,
                  gpu_memory=parse_size(args.gpu_memory))
    specs = loaded.family.layer_specs()
    n = policy.block_size
    prompts = torch.randint(10, loaded.config.vocab_size - 1, (n, args.prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()
    if args.snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    result = new_record("gpu_memory_trace", args.model, args.model, gpu_memory=args.gpu_memory, commit=args.commit)
    result.update(policy=policy.to_dict(), prompt_len=args.prompt_len, gen_len=args.gen_len, sync=args.sync,
                  blocks=[])
    for label, gen in (("warm-up", 1), ("measured", args.gen_len)):
        peaks: dict[tuple, int] = defaultdict(int)
        state = {"high": torch.cuda.memory_allocated(), "snapshot": None}

        def hook(action, peaks=peaks, state=state):
            if args.sync:
                torch.cuda.synchronize()
            used = torch.cuda.memory_allocated()
            key = (action.verb, "prefill" if action.i == 0 else "decode", specs[action.j].kind, action.k)
            peaks[key] = max(peaks[key], used)
            if args.snapshot and used > state["high"] + _STEP:
                state["snapshot"] = dict(summarize_snapshot(), at=list(key))
            state["high"] = max(state["high"], used)

        ex.on_action = hook
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ex.generate_block(prompts, [gen] * n, GreedyToEnd())
        block = {"label": label, "executor_gpu": ex.memory_report()["gpu"],
                 "torch_peak_gib": torch.cuda.max_memory_allocated() / GIB,
                 "top_actions": [{"action": list(k), "gib": v / GIB}
                                 for k, v in sorted(peaks.items(), key=lambda kv: -kv[1])[:10]],
                 "snapshot_at_peak": state["snapshot"]}
        result["blocks"].append(block)
        print(json.dumps(block, indent=1))
    ex.close()
    result["peak_device_gib"] = round(result["blocks"][-1]["torch_peak_gib"], 3)
    save_record(result, args.out)


if __name__ == "__main__":
    main()
