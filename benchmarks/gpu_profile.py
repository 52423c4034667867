"""Where a decode step's time goes: host seconds per schedule verb and the top device kernels.

Runs one dummy preset under one or more policies (a warm-up block, then a measured block of --gen-len steps,
as gpu_offload.py does). Host time per verb comes from the executor's `on_action` hook (time between one
action's start and the next's); device kernels come from torch.profiler over the measured block. Writes one
JSON object per policy to --out.

    python benchmarks/gpu_profile.py --model opt-6.7b --policy all_gpu_b8='{"gpu_batch_size": 8}' --out /tmp/p.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from engine.models.loader import load_model  # noqa: E402
from engine.policy.policy import Policy  # noqa: E402
from engine.runtime.executor import Executor  # noqa: E402
from engine.runtime.selector import GreedyToEnd  # noqa: E402
from engine.sizes import parse_size  # noqa: E402


def profile_policy(loaded, name: str, policy: Policy, args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ex = Executor(loaded, policy, device=device, dtype=torch.float16 if device.type == "cuda" else torch.float32,
                  gpu_memory=parse_size(args.gpu_memory) if device.type == "cuda" else None)
    specs = loaded.family.layer_specs()
    n = policy.block_size
    prompts = torch.randint(10, loaded.config.vocab_size - 1, (n, args.prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()
    ex.generate_block(prompts, [2] * n, GreedyToEnd())
    host: dict[str, float] = defaultdict(float)
    last = {"key": None, "t": 0.0}

    def hook(action):
        now = time.perf_counter()
        if last["key"] is not None:
            host[last["key"]] += now - last["t"]
        phase = "prefill" if action.i == 0 else "decode"
        last.update(key=f"{phase}.{action.verb}.{specs[action.j].kind}", t=now)

    ex.on_action = hook
    ex.timing = True
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        ex.generate_block(prompts, [args.gen_len] * n, GreedyToEnd())
    ex.close()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: -getattr(e, key, 0))[:20]
    return {
        "name": name, "policy": policy.to_dict(), "stats": dict(ex.stats),
        "decode_ms_per_step": 1e3 * ex.stats["decode_s"] / max(1, ex.stats["steps"] - 1),
        "host_s_by_verb": dict(sorted(host.items(), key=lambda kv: -kv[1])),
        "top_ops": [{"op": e.key, "count": e.count, "self_ms": getattr(e, key, 0) / 1e3,
                     "cpu_ms": e.self_cpu_time_total / 1e3} for e in events],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-6.7b")
    ap.add_argument("--policy", action="append", required=True, help="NAME=policy JSON (repeatable)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--gpu-memory", default="16GiB")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=torch.float16)
    results = []
    for item in args.policy:
        name, _, spec = item.partition("=")
        res = profile_policy(loaded, name, Policy.from_dict(json.loads(spec)), args)
        top_host = dict(list(res["host_s_by_verb"].items())[:12])
        print(json.dumps({"name": name, "decode_ms_per_step": res["decode_ms_per_step"], "host_s": top_host}, indent=1))
        for op in res["top_ops"][:12]:
            print(f"   {op['self_ms']:9.1f} ms dev  {op['cpu_ms']:9.1f} ms cpu  x{op['count']:<6} {op['op'][:70]}")
        results.append(res)
        args.out.write_text(json.dumps({"model": args.model, "prompt_len": args.prompt_len,
                                        "gen_len": args.gen_len, "results": results}, indent=1))


if __name__ == "__main__":
    main()
