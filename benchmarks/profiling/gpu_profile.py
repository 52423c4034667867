"""Where a block's time goes: host seconds per schedule verb and the top device kernels.

Runs one dummy preset under one or more policies (a warm-up block, then a measured block of --gen-len steps,
as throughput/throughput.py does). Host time per verb comes from the executor's `on_action` hook (time between one
action's start and the next's; "sync" is the host waiting for transfers); device kernels come from
torch.profiler over the measured block (`--no-kernels` skips it). With `--trial`, each policy is also run the
same way on the smaller of the copies the policy trials use (`engine.calibrate.trial`), and the trial's extrapolated
tokens/s is recorded next to the full model's measurement, with both runs' seconds per decoder layer: where
a trial mispredicts, the verbs say which part does not scale. Writes one record (common fields; tokens_per_s
the first policy's, one entry per policy in `results`; workload --workload, default the model), rewritten in
place after every policy in benchmarks/records/<machine>/gpu_profile.jsonl (or --out).

    python benchmarks/profiling/gpu_profile.py --model opt-6.7b --policy all_gpu_b8='{"gpu_batch_size": 8}' --out /tmp/p.jsonl
    python benchmarks/profiling/gpu_profile.py --model opt-30b --trial --no-kernels --policy A='{...}' --workload opt-30b-trial
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import (add_record_args, new_record, peak_gib, release_memory, reset_peak,  # noqa: E402
                               record_path, rewrite_jsonl, torch_device)

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from engine.models.loader import load_model  # noqa: E402
from engine.policy.cost_model import Workload  # noqa: E402
from engine.policy.policy import Policy  # noqa: E402
from engine.calibrate.trial import TRIAL_LAYERS, full_block, trial_seconds, truncated_model  # noqa: E402
from engine.runtime.executor import Executor  # noqa: E402
from engine.runtime.selector import GreedyToEnd  # noqa: E402
from engine.util.sizes import parse_size  # noqa: E402


# (module, attribute path) of the engine functions `--annotate` wraps in profiler ranges ("annotate.<name>")
ANNOTATED = [("engine.runtime.kv_cache", n) for n in (
    "KVHome.decode", "KVHome.store", "KVHome.load", "KVHome.settle", "StagingClaims.claim", "_write", "_dense",
    "_dense_with_new", "quantize", "decode_attention")] + [
    ("engine.runtime.transfers", "Pending.wait"), ("engine.runtime.transfers", "Transfers.submit_host"),
    ("engine.runtime.executor", "Executor._weights_for"), ("engine.runtime.executor", "Executor._head"),
    ("engine.models.opt", "OPTFamily.attn_qkv"), ("engine.models.opt", "OPTFamily.attn_out"),
    ("engine.models.opt", "OPTFamily.mlp"), ("engine.runtime.weight_homes", "WeightHomes.load")]


def annotate() -> None:
    """Wrap each ANNOTATED function in a torch.profiler range so key_averages() gives its inclusive host time
    (ranges cost ~1 us each: only for diagnosis runs)."""
    import functools
    import importlib

    from torch.profiler import record_function

    for module_name, path in ANNOTATED:
        owner = importlib.import_module(module_name)
        *outer, attr = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        fn = getattr(owner, attr)

        def wrapped(*a, _fn=fn, _name=f"annotate.{path}", **kw):
            with record_function(_name):
                return _fn(*a, **kw)
        setattr(owner, attr, functools.wraps(fn)(wrapped))


def _op_row(e, key: str) -> dict:
    return {"op": e.key, "count": e.count, "self_ms": getattr(e, key, 0) / 1e3, "cpu_ms": e.self_cpu_time_total / 1e3}


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds in, milliseconds out)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def device_busy(events) -> dict[str, float]:
    """Milliseconds each CUDA stream was busy (union of its kernels and copies), the union over all streams,
    and the span from the first device activity to the last: span >> any means the device waited (on the
    host or on latencies); any ~ one stream's busy time means that stream bounds the block."""
    by_stream: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.device_type == DeviceType.CUDA:
            by_stream[f"stream {e.device_resource_id}"].append((e.time_range.start, e.time_range.end))
    spans = [iv for ivs in by_stream.values() for iv in ivs]
    if not spans:
        return {}
    out = {name: _union_ms(ivs) for name, ivs in sorted(by_stream.items())}
    out["any"] = _union_ms(spans)
    out["span"] = (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e3
    return out


def profile_policy(loaded, name: str, policy: Policy, args) -> dict:
    device = torch_device()
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
    reset_peak()
    top_ops, top_host_ops, busy = [], [], {}
    if args.kernels:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            ex.generate_block(prompts, [args.gen_len] * n, GreedyToEnd())
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        averages = prof.key_averages()
        top_ops = [_op_row(e, key) for e in sorted(averages, key=lambda e: -getattr(e, key, 0))[:20]]
        top_host_ops = [_op_row(e, key) for e in sorted(averages, key=lambda e: -e.self_cpu_time_total)
                        if not e.key.startswith("annotate.")][:20]
        top_host_ops += [dict(_op_row(e, key), cpu_ms=e.cpu_time_total / 1e3) for e in averages
                         if e.key.startswith("annotate.")]
        busy = device_busy(prof.events())
    else:
        ex.generate_block(prompts, [args.gen_len] * n, GreedyToEnd())
    stats = dict(ex.stats)
    peak = peak_gib()                   # torch's peaks over the measured block
    ex.close()
    release_memory()
    layers = loaded.config.num_hidden_layers
    decode_steps = max(1, stats["steps"] - 1)
    return {
        "name": name, "policy": policy.to_dict(), "stats": stats, "decoder_layers": layers,
        "tokens_per_s": n * stats["steps"] / (stats["prefill_s"] + stats["decode_s"]),
        "decode_ms_per_step": 1e3 * stats["decode_s"] / decode_steps,
        "prefill_ms_per_layer": 1e3 * stats["prefill_s"] / layers,
        "decode_ms_per_layer_step": 1e3 * stats["decode_s"] / decode_steps / layers,
        "host_s_by_verb": dict(sorted(host.items(), key=lambda kv: -kv[1])),
        "top_ops": top_ops,
        "top_host_ops": top_host_ops,
        "device_busy_ms": busy,
        **peak,
    }


def trial_comparison(loaded, name: str, policy: Policy, args) -> dict:
    """The policy on the trial's smaller copy (same measurement as the full run) and the trial's own
    extrapolation of the full model's tokens/s at this --gen-len."""
    device = torch_device()
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    copy = truncated_model(loaded.config, TRIAL_LAYERS[0], dtype)
    workload = Workload(prompt_len=args.prompt_len, gen_len=args.gen_len, num_prompts=policy.block_size)
    times = trial_seconds(loaded.config, policy, workload, device, dtype)
    release_memory()
    return {"trial_tokens_per_s": full_block(loaded.config, times, args.gen_len, policy.block_size)[2],
            "trial_prefill_ms_per_layer": 1e3 * times.prefill_s_per_layer,
            "trial_decode_ms_per_layer_step": 1e3 * times.decode_s_per_layer_step,
            "copy_run": profile_policy(copy, name, policy, args)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-6.7b")
    ap.add_argument("--policy", action="append", required=True, help="NAME=policy JSON (repeatable)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--gpu-memory", default="16GiB")
    ap.add_argument("--workload", default=None, help="the record's workload (default: the model)")
    add_record_args(ap)
    ap.add_argument("--no-kernels", dest="kernels", action="store_false", help="skip torch.profiler")
    ap.add_argument("--trial", action="store_true", help="also run the trial (2- and 6-layer copies) and its estimate")
    ap.add_argument("--annotate", action="store_true",
                    help="profiler ranges around the engine's hot functions (their inclusive host ms in top_host_ops)")
    args = ap.parse_args()
    if args.annotate:
        annotate()
    loaded = load_model(args.model, dtype=torch.float16)
    workload = args.workload or args.model
    out = args.out or record_path("gpu_profile")
    record = new_record("gpu_profile", workload, args.model, gpu_memory=args.gpu_memory or None,
                        commit=args.commit)
    record.update(prompt_len=args.prompt_len, gen_len=args.gen_len, results=[])
    results = record["results"]
    for item in args.policy:
        name, _, spec = item.partition("=")
        policy = Policy.from_dict(json.loads(spec))
        res = profile_policy(loaded, name, policy, args)
        if args.trial:
            res["trial"] = trial_comparison(loaded, name, policy, args)
        top_host = dict(list(res["host_s_by_verb"].items())[:12])
        brief = {k: res[k] for k in ("name", "tokens_per_s", "prefill_ms_per_layer", "decode_ms_per_layer_step")}
        if args.trial:
            brief.update({k: v for k, v in res["trial"].items() if k != "copy_run"})
            brief["copy_host_s"] = dict(list(res["trial"]["copy_run"]["host_s_by_verb"].items())[:8])
        print(json.dumps({**brief, "host_s": top_host}, indent=1))
        print(f"  device busy ms: {res['device_busy_ms']}")
        for title, ops in (("device", res["top_ops"][:12]), ("host", res["top_host_ops"])):
            print(f"  top ops by {title} time")
            for op in ops:
                print(f"   {op['self_ms']:9.1f} ms dev  {op['cpu_ms']:9.1f} ms cpu  x{op['count']:<6} {op['op'][:70]}")
        results.append(res)
        record.update(tokens_per_s=results[0]["tokens_per_s"], peak_device_gib=results[0]["peak_device_gib"])
        rewrite_jsonl(out, record, ("run_id", "benchmark", "workload"))


if __name__ == "__main__":
    main()
