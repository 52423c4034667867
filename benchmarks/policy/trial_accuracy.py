"""Do trials predict the full model? Each policy's trial (`engine.calibrate.trial.trial_seconds`) next to a
full run of the same block on the same machine.

For one dummy preset and the named policies, runs (1) the trial the auto policy would run (2- and 6-layer
copies, the difference of their step times per layer) and (2) one block of the full model (token-id
prompts of --prompt-len, every row runs --gen-len tokens), and records both throughputs, both per-layer times
and the ratio trial / full. Policies come from --policy NAME=JSON (repeatable). Results (one record: common
fields, tokens_per_s the first full run's, one entry per policy) is rewritten in place after every policy in
benchmarks/records/<machine>/trial_accuracy.jsonl (or --out).

    python benchmarks/policy/trial_accuracy.py --model opt-6.7b --gen-len 32 \\
        --policy q4_64='{"gpu_batch_size": 64, "compress_weights": true, "compress_cache": true}'
    python benchmarks/policy/trial_accuracy.py --model tiny-opt --device cpu --prompt-len 16 --gen-len 4 \\
        --policy a='{"gpu_batch_size": 2}' --out /tmp/t.jsonl                 # smoke test on a CPU
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import Timer, add_record_args, new_record, record_path, release_memory, rewrite_jsonl  # noqa: E402

import torch  # noqa: E402

from engine.models.loader import load_model  # noqa: E402
from engine.policy.cost_model import Workload  # noqa: E402
from engine.policy.estimate import Budgets  # noqa: E402
from engine.policy.policy import Policy  # noqa: E402
from engine.calibrate.trial import TRIAL_LAYERS, full_block, trial_seconds  # noqa: E402
from benchmarks.policy.policy_validation import parse_budgets, run_policy  # noqa: E402


def policies_from(args) -> list[tuple[str, Policy]]:
    """(name, policy) of each --policy NAME=JSON."""
    return [(name, Policy.from_dict(json.loads(text))) for name, _, text in (p.partition("=") for p in args.policy)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-6.7b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gpu-memory", default="16GiB")
    ap.add_argument("--cpu-memory", default=None)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--policy", action="append", default=[], help="NAME=JSON of Policy fields (repeatable)")
    add_record_args(ap)
    args = ap.parse_args()
    args.disk_dir = None
    device = torch.device(args.device)
    record_fields = new_record("trial_accuracy", args.model, args.model, gpu_memory=args.gpu_memory,
                               device=None if device.type == "cuda" else "cpu", commit=args.commit)
    out = args.out or record_path("trial_accuracy")
    parse_budgets(args)
    loaded = load_model(args.model, dtype=torch.float16 if device.type == "cuda" else torch.float32)
    config = loaded.config
    payload = {**record_fields, "torch_device": str(device), "prompt_len": args.prompt_len, "gen_len": args.gen_len,
               "trial_layers": list(TRIAL_LAYERS), "gpu_memory": args.gpu_memory, "cpu_memory": args.cpu_memory,
               "results": []}
    if device.type == "cuda":
        payload["device_name"] = torch.cuda.get_device_name(device)
    budgets = Budgets(args.gpu_memory, args.cpu_memory, 0)
    for name, policy in policies_from(args):
        record: dict = {"name": name, "policy": policy.to_dict()}
        workload = Workload(args.prompt_len, args.gen_len, num_prompts=policy.block_size)
        try:
            with Timer() as trial:
                times = trial_seconds(config, policy, workload, device, loaded.dtype, budgets)
            record["trial"] = {"tokens_per_s": full_block(config, times, args.gen_len, policy.block_size)[2],
                               "prefill_ms_per_layer": 1e3 * times.prefill_s_per_layer,
                               "decode_ms_per_layer_step": 1e3 * times.decode_s_per_layer_step,
                               "wall_s": trial.seconds, **(times.detail or {})}
            release_memory()
            full = run_policy(loaded, policy, args, device)       # the same prompts as the trial's
            L, steps = config.num_hidden_layers, full["step_s"]
            record["full"] = {"setup_s": full["setup_s"], "step_s": steps,
                              "tokens_per_s": full["measured_tokens_per_s"],
                              "prefill_ms_per_layer": 1e3 * steps[0] / L,
                              "decode_ms_per_layer_step": 1e3 * sum(steps[1:]) / max(1, len(steps) - 1) / L,
                              "peak_device_gib": full.get("peak_device_gib")}
            record["trial_over_full"] = record["trial"]["tokens_per_s"] / record["full"]["tokens_per_s"]
        except BaseException as exc:  # noqa: BLE001 - OOM and engine errors are results here
            if isinstance(exc, KeyboardInterrupt):
                raise
            record["error"] = f"{type(exc).__name__}: {exc}"
            record["traceback"] = traceback.format_exc(limit=4)
        release_memory()
        payload["results"].append(record)
        full_runs = [r["full"] for r in payload["results"] if "full" in r]
        if full_runs:
            payload.update(tokens_per_s=full_runs[0]["tokens_per_s"], peak_device_gib=full_runs[0]["peak_device_gib"])
        rewrite_jsonl(out, payload, ("run_id", "benchmark", "workload"))
        print(json.dumps({"name": name, "trial": record.get("trial", {}).get("tokens_per_s"),
                          "full": record.get("full", {}).get("tokens_per_s"),
                          "ratio": record.get("trial_over_full"), "error": record.get("error")}), flush=True)


if __name__ == "__main__":
    main()
