"""Does the cost model rank policies the way the engine runs them? Predicted vs measured throughput.

For each model (dummy-weight presets, default OPT-6.7B and OPT-30B) under a GPU budget (default 16 GiB),
runs the auto policy (`search`) and several hand-made ones through `engine.runtime.executor.Executor`: one
block of token-id prompts (length 512, 32 new tokens, every row runs to the end). Records per policy the
prediction, the measured generated tokens/s (wall clock of `generate_block`, device synchronized) or the
error (out-of-memory and others are caught and recorded), then per model and overall the Spearman rank
correlation and the auto policy's measured / best measured ratio. Results are rewritten after every
policy to `<out>/policy_validation.json`, so a run cut short still leaves what it measured.

Time bound: a policy is skipped (and recorded as skipped) when its expected setup + run time, from the
prediction with a safety factor, exceeds what remains of `--time-budget-s` (default 450 s).

    python benchmarks/policy_validation.py --out "$OUT"                 # on the H200, ~8 minutes
    python benchmarks/policy_validation.py --models tiny-opt --device cpu --gpu-memory 1GiB --cpu-memory 2GiB \
        --prompt-len 16 --gen-len 4 --hardware default                  # smoke test on a CPU
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.models.loader import load_model  # noqa: E402
from engine.policy import model_stats as ms  # noqa: E402
from engine.policy.cost_model import Workload, estimate  # noqa: E402
from engine.policy.estimate import Budgets, NoFeasiblePolicy  # noqa: E402
from engine.policy.hardware import GIB, default_cpu_profile, load_or_measure, reference_profile  # noqa: E402
from engine.policy.policy import Policy  # noqa: E402
from engine.policy.search import search  # noqa: E402
from engine.sizes import parse_size  # noqa: E402

PIN_GIB_S = 1.5          # host pinning rate (ENVIRONMENT.md: 1.58 GiB/s) for the setup-time guess
SAFETY = 3.0             # measured runs may be this much slower than predicted


def hand_policies(name: str) -> list[tuple[str, Policy]]:
    """Hand-made policies spanning the space (batch shapes, placement, cpu attention, compression)."""
    if name == "opt-6.7b":
        return [
            ("all-gpu bs2", Policy(gpu_batch_size=2)),
            ("all-gpu bs8", Policy(gpu_batch_size=8)),
            ("w80 cache-cpu cpu-att bs32", Policy(gpu_batch_size=32, w_gpu=0.8, w_cpu=0.2, cache_gpu=0.0,
                                                  cache_cpu=1.0, cpu_attention=True)),
            ("w50 bs16x2", Policy(gpu_batch_size=16, num_gpu_batches=2, w_gpu=0.5, w_cpu=0.5)),
            ("4bit all-gpu bs64", Policy(gpu_batch_size=64, compress_weights=True, compress_cache=True)),
        ]
    if name == "opt-30b":
        return [
            ("w20 cache-cpu cpu-att bs8x8", Policy(gpu_batch_size=8, num_gpu_batches=8, w_gpu=0.2, w_cpu=0.8,
                                                   cache_gpu=0.0, cache_cpu=1.0, cpu_attention=True)),
            ("w20 cache-gpu bs4", Policy(gpu_batch_size=4, w_gpu=0.2, w_cpu=0.8)),
            ("w0 cache-cpu cpu-att bs32x2", Policy(gpu_batch_size=32, num_gpu_batches=2, w_gpu=0.0, w_cpu=1.0,
                                                   cache_gpu=0.0, cache_cpu=1.0, cpu_attention=True)),
            ("4bit w-cpu cache-gpu bs48", Policy(gpu_batch_size=48, w_gpu=0.0, w_cpu=1.0,
                                                 compress_weights=True, compress_cache=True)),
        ]
    return [("all-gpu bs2", Policy(gpu_batch_size=2)), ("all-gpu bs4x2", Policy(gpu_batch_size=4, num_gpu_batches=2)),
            ("w50 cache-cpu cpu-att bs4", Policy(gpu_batch_size=4, w_gpu=0.5, w_cpu=0.5, cache_gpu=0.0,
                                                 cache_cpu=1.0, cpu_attention=True))]


class RunToEnd:
    """A TokenSelector: greedy argmax, never finished (rows stop at max_new_tokens)."""

    def __call__(self, rows, logits):
        return logits.argmax(dim=-1).tolist(), [False] * len(rows)


def spearman(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None
    from scipy.stats import spearmanr

    return float(spearmanr(xs, ys).statistic)


def run_policy(loaded, policy: Policy, args, device: torch.device) -> dict:
    """Build an executor, run one block, return measured numbers (raises on failure)."""
    from engine.runtime.executor import Executor

    g = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(policy.block_size)]
    t0 = time.perf_counter()
    executor = Executor(loaded, policy, device=device, dtype=loaded.dtype, gpu_memory=args.gpu_memory,
                        cpu_memory=args.cpu_memory, disk_dir=args.disk_dir)
    try:
        setup_s = time.perf_counter() - t0
        executor.timing = True
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t1 = time.perf_counter()
        executor.generate_block(prompts, [args.gen_len] * len(prompts), RunToEnd())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        run_s = time.perf_counter() - t1
        out = {"setup_s": setup_s, "run_s": run_s, "measured_tokens_per_s": len(prompts) * args.gen_len / run_s,
               "executor_stats": dict(executor.stats), "memory_report": executor.memory_report()}
        if device.type == "cuda":
            out["torch_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            out["torch_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        return out
    finally:
        executor.close()


def write(out_dir: Path, payload: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "policy_validation.json.tmp"
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))
    os.replace(tmp, out_dir / "policy_validation.json")


def summarize(payload: dict) -> None:
    all_pred, all_meas = [], []
    for model, entry in payload["models"].items():
        ok = [r for r in entry["policies"] if "measured_tokens_per_s" in r]
        pred = [r["predicted_tokens_per_s"] for r in ok]
        meas = [r["measured_tokens_per_s"] for r in ok]
        all_pred += pred
        all_meas += meas
        entry["spearman"] = spearman(pred, meas)
        best = max(meas, default=None)
        auto = next((r for r in ok if r["name"] == "auto"), None)
        entry["auto_measured_over_best"] = (auto["measured_tokens_per_s"] / best) if (auto and best) else None
    payload["spearman_all"] = spearman(all_pred, all_meas)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--models", default="opt-6.7b,opt-30b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gpu-memory", default="16GiB")
    ap.add_argument("--cpu-memory", default=None, help="default: 85%% of available RAM, at most 110GiB")
    ap.add_argument("--disk-dir", default=None)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--max-block", type=int, default=256, help="bound on the auto policy's block size")
    ap.add_argument("--hardware", default="local", choices=["local", "h200", "default"])
    ap.add_argument("--time-budget-s", type=float, default=450.0)
    args = ap.parse_args()
    start = time.perf_counter()
    device = torch.device(args.device)
    args.gpu_memory = parse_size(args.gpu_memory)
    if args.cpu_memory is None:
        from engine.policy.hardware import host_memory_bytes
        args.cpu_memory = int(min(0.85 * host_memory_bytes(), 110 * GIB))
    else:
        args.cpu_memory = parse_size(args.cpu_memory)
    profile = {"local": lambda: load_or_measure(device), "h200": lambda: reference_profile("h200"),
               "default": default_cpu_profile}[args.hardware]()
    workload = Workload(args.prompt_len, args.gen_len, num_prompts=args.max_block)
    budgets = Budgets(args.gpu_memory, args.cpu_memory, 0)
    payload = {"device": str(device), "profile": profile.to_dict(), "workload": vars(args) | {"out": str(args.out)},
               "models": {}}
    out_dir = Path(args.out)
    for name in args.models.split(","):
        loaded = load_model(name, dtype=torch.float16 if device.type == "cuda" else torch.float32)
        bpe = ms.dtype_bytes(loaded.dtype)
        entry = payload["models"][name] = {"policies": []}
        candidates: list[tuple[str, Policy]] = []
        try:
            auto = search(loaded.config, workload, budgets, profile, bytes_per_element=bpe, model_name=name)
            candidates.append(("auto", auto.policy))
            entry["auto_explain"] = auto.explain()
        except NoFeasiblePolicy as exc:
            entry["auto_error"] = str(exc)
        candidates += hand_policies(name)
        weights_gib = ms.total_numel(loaded.config) * bpe / GIB
        for label, policy in candidates:
            est = estimate(loaded.config, policy, replace(workload, num_prompts=None), profile, bpe)
            record = {"name": label, "policy": policy.to_dict(), "predicted_tokens_per_s": est.tokens_per_s,
                      "predicted_prefill_s": est.prefill_s, "predicted_decode_s": est.decode_s,
                      "predicted_peak_gib": {t: v / GIB for t, v in est.peak_memory_bytes.items()}}
            expected = weights_gib / PIN_GIB_S + SAFETY * est.total_s + 5
            remaining = args.time_budget_s - (time.perf_counter() - start)
            if expected > remaining:
                record["skipped"] = f"expected {expected:.0f} s > {remaining:.0f} s left of the time budget"
            else:
                try:
                    record.update(run_policy(loaded, policy, args, device))
                except BaseException as exc:  # noqa: BLE001 - OOM and engine errors are results here
                    if isinstance(exc, KeyboardInterrupt):
                        raise
                    record["error"] = f"{type(exc).__name__}: {exc}"
                    record["oom"] = "out of memory" in str(exc).lower() or isinstance(exc, MemoryError)
                    record["traceback"] = traceback.format_exc(limit=4)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            entry["policies"].append(record)
            summarize(payload)
            payload["elapsed_s"] = time.perf_counter() - start
            write(out_dir, payload)
            print(json.dumps({k: record.get(k) for k in ("name", "predicted_tokens_per_s", "measured_tokens_per_s",
                                                          "error", "skipped")}), flush=True)
        del loaded
        gc.collect()
    summarize(payload)
    write(out_dir, payload)
    print(json.dumps({m: {"spearman": e.get("spearman"), "auto_measured_over_best": e.get("auto_measured_over_best")}
                      for m, e in payload["models"].items()} | {"spearman_all": payload.get("spearman_all")}))


if __name__ == "__main__":
    main()
