"""Does the cost model rank policies the way the engine runs them? Predicted vs measured throughput.

For each model (dummy-weight presets, default OPT-6.7B at gen 32 and OPT-30B at gen 8) under a GPU budget
(default 16 GiB), runs through `engine.runtime.executor.Executor` one block of token-id prompts (length
512, every row runs to the end) of each distinct policy among:
  - "auto (model only)": `search_top(...)[0]`, the cost model's choice;
  - "auto (with trials)": the best measured of `search_top`'s `--trials` candidates, each run for one short
    block on 2- and 6-layer copies of the model and counted at most at its prediction
    (`engine.calibrate.trial.best_by_trials`, what `choose_policy_estimate(trials=N)` does on CUDA);
  - >= 8 hand-made grid policies spanning the space (`grid_policies`), or with `--grid-from FILE` the grid
    measured by an earlier run (only the autos run; each copied record names its source and is predicted
    again with this run's profile and cost model).
With `--compress auto` (default) the autos may choose 4-bit weights/cache and are compared with the whole
grid; with `--compress off` they may not, and are compared with the grid's uncompressed policies.
A policy chosen under several names is measured once. Records per policy the prediction, the measured
generated tokens/s (`steady_tokens_per_s`: prefill + decode as the executor clocks them; the block's wall
time, which also holds first-use setup, is `wall_tokens_per_s`) or the error, then per model the
Spearman rank correlation over all measured policies, the best one and each auto's measured / best
measured. Results (one record: common fields, tokens_per_s the best measured, peak_device_gib the largest
torch peak, `all_within_budget` whether every measured policy's torch peak stayed within --gpu-memory (each
policy's `within_budget`); `models` per model; workload the model names joined by "+") is rewritten in place
after every policy in benchmarks/records/<machine>/policy_validation.jsonl (or --out), so a run cut short keeps what it
measured.

Time bound: autos run first, then the grid from the cheapest predicted; a policy is skipped (and recorded
as skipped) when its expected setup + run time exceeds what remains of this model's share of
`--time-budget-s` (default 420 s; a model's unused share passes to the next). The first policy of a model
pins its cpu-tier memory (~1.5 GiB/s); later ones reuse torch's cached pinned blocks.

    python benchmarks/policy/policy_validation.py                        # on an H200, ~7 minutes
    python benchmarks/policy/policy_validation.py --models tiny-opt --device cpu --gpu-memory 1GiB --cpu-memory 2GiB \
        --prompt-len 16 --gen-len 4 --hardware default --max-block 8 --out /tmp/pv.jsonl   # smoke test on a CPU
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import Timer, add_record_args, new_record, read_records, record_path, rewrite_jsonl  # noqa: E402

import torch  # noqa: E402

from engine.models.loader import load_model  # noqa: E402
from engine.policy import model_stats as ms  # noqa: E402
from engine.policy.cost_model import Workload, estimate  # noqa: E402
from engine.policy.estimate import Budgets, NoFeasiblePolicy  # noqa: E402
from engine.calibrate.machine import default_cpu_profile
from engine.calibrate.profile_cache import load_or_measure
from engine.policy.hardware import GIB, reference_profile  # noqa: E402
from engine.policy.policy import Policy  # noqa: E402
from engine.runtime.layout import model_layout  # noqa: E402
from engine.runtime.selector import GreedyToEnd  # noqa: E402
from engine.util.sizes import parse_size  # noqa: E402

PIN_GIB_S = 1.5          # host pinning rate (GiB/s, `kernels/pin_speed.py`) for the setup-time guess
SAFETY = 3.0             # measured runs may be this much slower than predicted


def _p(g: int, k: int = 1, **kw) -> Policy:
    return Policy(gpu_batch_size=g, num_gpu_batches=k, **kw)


CPU_CACHE = dict(cache_gpu=0.0, cache_cpu=1.0)
W_CPU = dict(w_gpu=0.0, w_cpu=1.0)
Q4 = dict(compress_weights=True, compress_cache=True)


def grid_policies(name: str) -> list[tuple[str, Policy]]:
    """Hand-made policies spanning the space: batch shapes (one big GPU batch to many small ones), weights
    on gpu / split / on cpu, cache on gpu / split / on cpu with gpu or CPU attention, 4-bit weights and
    cache. Fractions are ones the executor realizes as stated (OPT-30B's weights cannot be split under
    16 GiB: a whole fc1 or qkv_proj per layer is already more)."""
    if name == "opt-6.7b":
        return [
            ("all-gpu bs2", _p(2)),
            ("all-gpu bs8", _p(8)),
            ("all-gpu bs2x4", _p(2, 4)),
            ("4bit all-gpu bs64", _p(64, **Q4)),
            ("4bit-w all-gpu bs16", _p(16, compress_weights=True)),
            ("w50 bs8", _p(8, w_gpu=0.5, w_cpu=0.5)),
            ("w80 cache-cpu cpu-att bs32", _p(32, w_gpu=0.8, w_cpu=0.2, cpu_attention=True, **CPU_CACHE)),
            ("w0 cache-cpu cpu-att bs64x2", _p(64, 2, cpu_attention=True, **W_CPU, **CPU_CACHE)),
            ("w50 cache-cpu gpu-att bs16x4", _p(16, 4, w_gpu=0.5, w_cpu=0.5, **CPU_CACHE)),
            ("4bit w-cpu cache-cpu cpu-att bs64x2", _p(64, 2, cpu_attention=True, **W_CPU, **CPU_CACHE, **Q4)),
            ("4bit-w cache-half gpu-att bs32", _p(32, compress_weights=True, cache_gpu=0.5, cache_cpu=0.5)),
        ]
    if name == "opt-30b":
        # the cpu tier holds at most default_cpu_budget() (70% of the H200 host's 125 GiB): fp16 weights on
        # the cpu are 56 GiB of it
        return [
            ("w0 cache-gpu bs8", _p(8, **W_CPU)),
            ("w0 cache-cpu cpu-att bs16", _p(16, cpu_attention=True, **W_CPU, **CPU_CACHE)),
            ("w0 cache-half cpu-att bs8x3", _p(8, 3, cpu_attention=True, cache_gpu=0.5, cache_cpu=0.5, **W_CPU)),
            ("w0 cache-cpu gpu-att bs16x2", _p(16, 2, **W_CPU, **CPU_CACHE)),
            ("4bit w-cpu cache-gpu bs32", _p(32, **W_CPU, **Q4)),
            ("4bit w-cpu cache-gpu bs16x3", _p(16, 3, **W_CPU, **Q4)),
            ("4bit w-cpu cache-gpu bs8x4", _p(8, 4, **W_CPU, **Q4)),
            ("4bit w-cpu cache-cpu gpu-att bs64", _p(64, **W_CPU, **CPU_CACHE, **Q4)),
            ("4bit w-cpu cache-cpu gpu-att bs24x4", _p(24, 4, **W_CPU, **CPU_CACHE, **Q4)),
            ("4bit-w cache-cpu cpu-att bs32x2", _p(32, 2, cpu_attention=True, compress_weights=True, **W_CPU,
                                                  **CPU_CACHE)),
        ]
    return [
        ("all-gpu bs2", _p(2)), ("all-gpu bs4x2", _p(4, 2)), ("all-gpu bs1x4", _p(1, 4)),
        ("w50 bs4", _p(4, w_gpu=0.5, w_cpu=0.5)),
        ("w50 cache-cpu cpu-att bs4", _p(4, w_gpu=0.5, w_cpu=0.5, cpu_attention=True, **CPU_CACHE)),
        ("w0 cache-cpu gpu-att bs2x2", _p(2, 2, **W_CPU, **CPU_CACHE)),
        ("4bit all-gpu bs8", _p(8, **Q4)),
        ("4bit w-cpu cache-cpu cpu-att bs4x2", _p(4, 2, cpu_attention=True, **W_CPU, **CPU_CACHE, **Q4)),
    ]


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
    with Timer() as setup:
        executor = Executor(loaded, policy, device=device, dtype=loaded.dtype, gpu_memory=args.gpu_memory,
                            cpu_memory=args.cpu_memory, disk_dir=args.disk_dir)
    try:
        setup_s = setup.seconds
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        with Timer() as run:
            executor.generate_block(prompts, [args.gen_len] * len(prompts), GreedyToEnd())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        run_s = run.seconds
        out = {"setup_s": setup_s, "run_s": run_s, "wall_tokens_per_s": len(prompts) * args.gen_len / run_s,
               "executor_stats": dict(executor.stats), "step_s": list(executor.step_s),
               "memory_report": executor.memory_report()}
        out["measured_tokens_per_s"] = steady_tokens_per_s(out, policy.block_size, args.gen_len)
        if device.type == "cuda":
            out["torch_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            out["torch_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
            out["peak_device_gib"] = round(out["torch_peak_allocated_gib"], 3)
            out["within_budget"] = torch.cuda.max_memory_allocated(device) <= args.gpu_memory
        return out
    finally:
        executor.close()


def steady_tokens_per_s(record: dict, block_size: int, gen_len: int) -> float:
    """Generated tokens/s of the block's prefill + decode as the executor clocks them (from token pick
    to token pick). Unlike the block's wall time (`wall_tokens_per_s`) it leaves out the block's first-use setup:
    the first policy of a model pins its cpu-tier homes inside its first block (~1.5 GiB/s), which every
    later block of a run, and every later policy here, reuses."""
    stats = record["executor_stats"]
    return block_size * gen_len / (stats["prefill_s"] + stats["decode_s"])


def parse_budgets(args) -> None:
    """`args.gpu_memory` / `args.cpu_memory` from size strings to bytes (cpu None: the engine's default budget)."""
    from engine.calibrate.machine import default_cpu_budget

    args.gpu_memory = parse_size(args.gpu_memory)
    args.cpu_memory = default_cpu_budget() if args.cpu_memory is None else parse_size(args.cpu_memory)


def write(out: Path, payload: dict) -> None:
    """The record's headline fields (best measured tokens/s, largest torch peak) from its policies, then the
    record, rewritten in place in `out` (atomically)."""
    done = [r for e in payload["models"].values() for r in e["policies"] if "measured_tokens_per_s" in r]
    payload["tokens_per_s"] = max((r["measured_tokens_per_s"] for r in done), default=None)
    payload["peak_device_gib"] = max((r["peak_device_gib"] for r in done if "peak_device_gib" in r), default=None)
    payload["all_within_budget"] = all(r.get("within_budget", True) for r in done)
    rewrite_jsonl(out, payload, ("run_id", "benchmark", "workload"))


AUTO_MODEL, AUTO_TRIALS = "auto (model only)", "auto (with trials)"


def summarize(payload: dict) -> None:
    """Per model: Spearman of predicted vs measured over every measured distinct policy, the best measured,
    and each auto policy's measured / best measured; overall Spearman."""
    all_pred, all_meas = [], []
    for entry in payload["models"].values():
        ok = [r for r in entry["policies"] if "measured_tokens_per_s" in r]
        pred = [r["predicted_tokens_per_s"] for r in ok]
        meas = [r["measured_tokens_per_s"] for r in ok]
        all_pred += pred
        all_meas += meas
        entry["spearman"] = spearman(pred, meas)
        entry["measured_policies"] = len(ok)
        if entry.get("compress", "off") == "off":      # the autos were not allowed to compress: compare alike
            ok = [r for r in ok if not (r["policy"]["compress_weights"] or r["policy"]["compress_cache"])]
        best = max(ok, key=lambda r: r["measured_tokens_per_s"], default=None)
        entry["best"] = best["names"] if best else None
        for label, key in ((AUTO_MODEL, "auto_model_measured_over_best"), (AUTO_TRIALS, "auto_trials_measured_over_best")):
            auto = next((r for r in ok if label in r["names"]), None)
            entry[key] = auto["measured_tokens_per_s"] / best["measured_tokens_per_s"] if (auto and best) else None
    payload["spearman_all"] = spearman(all_pred, all_meas)


def earlier_grid(path: Path, name: str, gen_len: int) -> list[dict]:
    """The measured grid (non-auto) policies of `name` from an earlier record (the last one of a records file
    that measured `name`), marked with their source."""
    earlier = next((r["models"][name] for r in reversed(read_records(path)) if name in r.get("models", {})), None)
    if earlier is None:
        return []
    if earlier.get("gen_len") != gen_len:
        raise SystemExit(f"--grid-from {path}: {name} was measured at gen_len {earlier.get('gen_len')}, not {gen_len}")
    return [dict(r, names=[n for n in r["names"] if not n.startswith("auto")], source=str(path),
                 measured_tokens_per_s=steady_tokens_per_s(r, Policy.from_dict(r["policy"]).block_size, gen_len))
            for r in earlier["policies"]
            if "executor_stats" in r and any(not n.startswith("auto") for n in r["names"])]


def predicted(config, policy: Policy, workload: Workload, profile, bpe: int) -> dict:
    """The cost model's prediction for `policy` (one block, unbounded by the workload's row count)."""
    est = estimate(config, policy, replace(workload, num_prompts=None), profile, bpe,
                   layout=model_layout(config, bpe, policy.compress_weights))
    return {"predicted_tokens_per_s": est.tokens_per_s, "predicted_prefill_s": est.prefill_s,
            "predicted_decode_s": est.decode_s,
            "predicted_peak_gib": {t: v / GIB for t, v in est.peak_memory_bytes.items()}}


def parse_models(text: str, gen_len: int) -> list[tuple[str, int]]:
    """"opt-6.7b,opt-30b:8" -> [("opt-6.7b", gen_len), ("opt-30b", 8)]."""
    out = []
    for item in text.split(","):
        name, _, gen = item.partition(":")
        out.append((name, int(gen) if gen else gen_len))
    return out


def autos(loaded, name: str, workload: Workload, budgets: Budgets, profile, device: torch.device, args,
          entry: dict) -> list[tuple[str, Policy]]:
    """The model-only auto policy (`search`) and the trial-refined one (`choose_policy_estimate(trials=N)`
    on CUDA; on a CPU the same `search_top` + `best_by_trials` path, for the smoke test)."""
    from engine.policy.search import search_top
    from engine.calibrate.trial import best_by_trials

    bpe = ms.dtype_bytes(loaded.dtype)
    out = []
    try:
        allow = None if args.compress == "auto" else False
        with Timer() as searching:
            top = search_top(loaded.config, workload, budgets, profile, top=max(1, args.trials),
                             bytes_per_element=bpe, compress_weights=allow, compress_cache=allow, model_name=name,
                             layout=model_layout(loaded.config, bpe))
        entry["search_s"] = searching.seconds
        out.append((AUTO_MODEL, top[0].policy))
        entry["auto_model_explain"] = top[0].explain()
        if args.trials > 0:
            with Timer() as trying:
                chosen = best_by_trials(loaded.config, top, workload, device, loaded.dtype, budgets,
                                        time_budget_s=args.trial_time_s, disk_dir=args.disk_dir)
            entry["trials_s"] = trying.seconds
            entry["auto_trials_explain"] = chosen.explain()
            entry["auto_trials_log"] = chosen.context.get("trials")
            out.append((AUTO_TRIALS, chosen.policy))
    except NoFeasiblePolicy as exc:
        entry["auto_error"] = str(exc)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_record_args(ap)
    ap.add_argument("--models", default="opt-6.7b,opt-30b:8",
                    help="comma-separated NAME[:GEN_LEN] (default gen: --gen-len)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gpu-memory", default="16GiB")
    ap.add_argument("--cpu-memory", default=None, help="default: engine.calibrate.machine.default_cpu_budget() (PINNED_SHARE of the available RAM)")
    ap.add_argument("--disk-dir", default=None)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--max-block", type=int, default=256, help="bound on the auto policies' block size")
    ap.add_argument("--hardware", default="local", choices=["local", "h200", "default"])
    ap.add_argument("--trials", type=int, default=4, help="candidates the trial-refined auto measures")
    ap.add_argument("--trial-time-s", type=float, default=60.0)
    ap.add_argument("--time-budget-s", type=float, default=420.0)
    ap.add_argument("--compress", choices=["auto", "off"], default="auto",
                    help="auto: the auto policies may choose 4-bit weights/cache and are compared with the whole "
                         "grid; off: they may not, and are compared with the uncompressed grid policies only")
    ap.add_argument("--grid-from", type=Path,
                    help="for the models this earlier record (JSONL or JSON file) measured, run only the autos and take the grid's "
                         "measurements from it, predicted again with this run's profile and cost model (the "
                         "earlier prediction is kept as earlier_predicted_tokens_per_s); other models run their grid")
    return ap


def candidates(loaded, name: str, gen_len: int, workload: Workload, budgets: Budgets, profile,
               device: torch.device, args, entry: dict) -> list[dict]:
    """The distinct policies to measure for one model, each with its prediction: the autos first, then the grid
    from the cheapest predicted. With --grid-from, the earlier grid's measured records join `entry` (predicted
    again) and only the autos are returned for measuring."""
    bpe = ms.dtype_bytes(loaded.dtype)
    named = autos(loaded, name, workload, budgets, profile, device, args, entry)
    earlier = earlier_grid(args.grid_from, name, gen_len) if args.grid_from is not None else []
    for record in earlier:          # the earlier measurement against this run's profile and cost model
        record["earlier_predicted_tokens_per_s"] = record["predicted_tokens_per_s"]
        record.update(predicted(loaded.config, Policy.from_dict(record["policy"]), workload, profile, bpe))
    if earlier:
        entry["policies"] += earlier
    else:
        named += grid_policies(name)
    distinct: dict[Policy, list[str]] = {}
    for label, policy in named:
        distinct.setdefault(policy, []).append(label)
    records = []
    for policy, names in distinct.items():
        fields = predicted(loaded.config, policy, workload, profile, bpe)
        records.append({"names": names, "policy": policy.to_dict(), **fields,
                        "_total_s": fields["predicted_prefill_s"] + fields["predicted_decode_s"],
                        "_auto": names[0].startswith("auto")})
    records.sort(key=lambda r: (not r["_auto"], r["_total_s"]))    # autos first, then the cheapest
    return records


def measure(record: dict, loaded, gen_len: int, args, device: torch.device, first: bool, remaining_s: float) -> bool:
    """Run `record`'s policy unless it is predicted not to fit or to outlast `remaining_s` (then `skipped` says
    why); an error or OOM is recorded, not raised. True when it ran."""
    policy = Policy.from_dict(record["policy"])
    cpu_gib = record["predicted_peak_gib"]["cpu"]
    expected = 5 + cpu_gib / (PIN_GIB_S if first else 8.0) + SAFETY * record.pop("_total_s")
    record.pop("_auto")
    ran = False
    if record["predicted_peak_gib"]["gpu"] * GIB > args.gpu_memory:
        record["skipped"] = "predicted not to fit the gpu budget"
    elif expected > remaining_s:
        record["skipped"] = f"expected {expected:.0f} s > {remaining_s:.0f} s left of this model's time"
    else:
        try:
            record.update(run_policy(loaded, policy, replace_gen(args, gen_len), device))
            ran = True
        except BaseException as exc:  # noqa: BLE001 - OOM and engine errors are results here
            if isinstance(exc, KeyboardInterrupt):
                raise
            record["error"] = f"{type(exc).__name__}: {exc}"
            record["oom"] = "out of memory" in str(exc).lower() or isinstance(exc, MemoryError)
            record["traceback"] = traceback.format_exc(limit=4)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ran


def main() -> None:
    args = build_parser().parse_args()
    start = time.perf_counter()
    device = torch.device(args.device)
    gpu_memory_text = args.gpu_memory
    parse_budgets(args)
    models = parse_models(args.models, args.gen_len)
    out = args.out or record_path("policy_validation")
    with Timer() as profiling:
        profile = {"local": lambda: load_or_measure(device), "h200": lambda: reference_profile("h200"),
                   "default": default_cpu_profile}[args.hardware]()
    payload = new_record("policy_validation", "+".join(name for name, _ in models), args.models,
                         gpu_memory=gpu_memory_text, device=None if device.type == "cuda" else "cpu", commit=args.commit)
    payload.update({"torch_device": str(device), "profile": profile.to_dict(), "profile_s": profiling.seconds,
                    "args": vars(args) | {"out": str(out)}, "models": {}})
    budgets = Budgets(args.gpu_memory, args.cpu_memory, 0)
    for m, (name, gen_len) in enumerate(models):
        now = time.perf_counter()
        model_deadline = now + (args.time_budget_s - (now - start)) / (len(models) - m)   # leftovers pass on
        loaded = load_model(name, dtype=torch.float16 if device.type == "cuda" else torch.float32)
        workload = Workload(args.prompt_len, gen_len, num_prompts=args.max_block)
        entry = payload["models"][name] = {"gen_len": gen_len, "policies": [], "compress": args.compress}
        first = True
        for record in candidates(loaded, name, gen_len, workload, budgets, profile, device, args, entry):
            if measure(record, loaded, gen_len, args, device, first, model_deadline - time.perf_counter()):
                first = False
            entry["policies"].append(record)
            summarize(payload)
            payload["elapsed_s"] = time.perf_counter() - start
            write(out, payload)
            print(json.dumps({k: record.get(k) for k in ("names", "predicted_tokens_per_s", "measured_tokens_per_s",
                                                          "error", "skipped")}), flush=True)
        del loaded
        gc.collect()
    summarize(payload)
    write(out, payload)
    print(json.dumps({m: {k: e.get(k) for k in ("spearman", "measured_policies", "best",
                                                "auto_model_measured_over_best", "auto_trials_measured_over_best")}
                      for m, e in payload["models"].items()} | {"spearman_all": payload.get("spearman_all")}))


def replace_gen(args, gen_len: int):
    """`args` with this model's generation length (run_policy reads args.gen_len)."""
    copy = argparse.Namespace(**vars(args))
    copy.gen_len = gen_len
    return copy


if __name__ == "__main__":
    main()
