"""Offloading throughput on one GPU with dummy weights (FlexGen's setting): prompt 512, gen 32, gpu_memory cap.

Runs the engine's `Executor` on a dummy preset (`opt-6.7b`, `opt-30b`, ...) under several policies and writes
one record per model (workload = the preset) to OUT_DIR/gpu_offload_<model>.json, rewritten after every
policy: the common fields (tokens_per_s, peak_device_gib: the best policy's) and per policy the Policy fields,
generated tokens/s (all generated tokens over prefill + decode wall time), decode tokens/s, prefill/decode
seconds, peak device memory (torch.cuda.max_memory_allocated) and the executor's own per-tier byte counts.
All records of one invocation share its run_id. OUT_DIR defaults to $OUT, else benchmarks/results.

    python benchmarks/gpu_offload.py --model opt-6.7b --model opt-30b --out-dir "$OUT"
    python benchmarks/gpu_offload.py --model opt-30b --policy '{"gpu_batch_size": 24, "num_gpu_batches": 2,
        "w_gpu": 0, "w_cpu": 1, "compress_weights": true, "compress_cache": true}' --out-dir /tmp/out
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/: bench_common
from bench_common import (GIB, Timer, add_record_args, new_record, new_run_id, results_path,  # noqa: E402
                          save_record, torch_device)

import torch  # noqa: E402

from engine.models.loader import load_model  # noqa: E402
from engine.policy.policy import Policy  # noqa: E402
from engine.runtime.executor import Executor  # noqa: E402
from engine.runtime.selector import GreedyToEnd  # noqa: E402
from engine.util.sizes import parse_size  # noqa: E402

SUITES: dict[str, dict[str, dict]] = {
    "opt-6.7b": {
        "all_gpu_b8": dict(gpu_batch_size=8, num_gpu_batches=1),
        "4bit_all_gpu_b96": dict(gpu_batch_size=32, num_gpu_batches=3, compress_weights=True, compress_cache=True),
        "w_cpu_cache_gpu_b32": dict(gpu_batch_size=16, num_gpu_batches=2, w_gpu=0.0, w_cpu=1.0),
        "w_half_cache_cpu_attn_b64": dict(gpu_batch_size=32, num_gpu_batches=2, w_gpu=0.5, w_cpu=0.5,
                                           cache_gpu=0.0, cache_cpu=1.0, cpu_attention=True),
    },
    "opt-30b": {
        "w_cpu_cache_gpu_b12": dict(gpu_batch_size=6, num_gpu_batches=2, w_gpu=0.0, w_cpu=1.0),
        "4bit_w_cpu_cache_gpu_b48": dict(gpu_batch_size=16, num_gpu_batches=3, w_gpu=0.0, w_cpu=1.0,
                                         compress_weights=True, compress_cache=True),
        "w_cpu_cache_cpu_attn_b32": dict(gpu_batch_size=16, num_gpu_batches=2, w_gpu=0.0, w_cpu=1.0,
                                          cache_gpu=0.0, cache_cpu=1.0, cpu_attention=True),
    },
}


def run_one(loaded, name: str, policy: Policy, args) -> dict:
    device = torch_device()
    result = {"name": name, "policy": policy.to_dict(), "prompt_len": args.prompt_len, "gen_len": args.gen_len}
    ex = None
    try:
        torch.cuda.empty_cache() if device.type == "cuda" else None
        with Timer() as init:
            ex = Executor(loaded, policy, device=device, dtype=torch.float16, gpu_memory=args.gpu_memory,
                          cpu_memory=args.cpu_memory, disk_dir=args.disk_dir)
        result["init_s"] = init.seconds
        ex.timing = True
        n = policy.block_size
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(10, loaded.config.vocab_size - 1, (n, args.prompt_len), generator=g).tolist()
        if args.warmup:
            ex.generate_block(prompts, [1] * n, GreedyToEnd())
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        counter = GreedyToEnd()
        with Timer() as block:
            ex.generate_block(prompts, [args.gen_len] * n, counter)
        total = block.seconds
        prefill, decode = ex.stats["prefill_s"], ex.stats["decode_s"]
        result.update(
            ok=True, generated_tokens=counter.tokens, total_s=total, prefill_s=prefill, decode_s=decode,
            tokens_per_s=counter.tokens / total,
            decode_tokens_per_s=n * (args.gen_len - 1) / decode if decode > 0 else None,
            peak_device_bytes=torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
            peak_device_gib=round(torch.cuda.max_memory_allocated() / GIB, 3) if device.type == "cuda" else None,
            executor_memory=ex.memory_report(),
        )
        if result["peak_device_bytes"] is not None and args.gpu_memory is not None:
            result["within_budget"] = result["peak_device_bytes"] <= args.gpu_memory
    except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError, ValueError) as err:
        result.update(ok=False, error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-2000:])
    finally:
        if ex is not None:
            ex.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="dummy preset name (repeatable); default opt-6.7b and opt-30b")
    ap.add_argument("--policy", action="append", help="a Policy as JSON (repeatable); default: the model's suite")
    ap.add_argument("--only", action="append", help="run only these suite policy names")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--gpu-memory", default="16GiB")
    ap.add_argument("--cpu-memory", default=None)
    ap.add_argument("--disk-dir", default="/tmp/llmops-offload")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="folder of the gpu_offload_<model>.json files (default $OUT, else benchmarks/results)")
    add_record_args(ap, out_help="one model's result file (one --model only; default OUT_DIR/gpu_offload_<model>.json)")
    args = ap.parse_args()
    gpu_memory_text = args.gpu_memory
    args.gpu_memory = parse_size(args.gpu_memory) if args.gpu_memory else None
    args.cpu_memory = parse_size(args.cpu_memory) if args.cpu_memory else None
    models = args.model or ["opt-6.7b", "opt-30b"]
    if args.out is not None and len(models) > 1:
        raise SystemExit("--out names one file: give one --model (or use --out-dir)")
    run_id = new_run_id()
    for model in models:
        out = args.out or results_path("gpu_offload", model, folder=args.out_dir)
        record = new_record("gpu_offload", model, model, gpu_memory=gpu_memory_text or None, commit=args.commit,
                            run_id=run_id)
        record.update(prompt_len=args.prompt_len, gen_len=args.gen_len)
        loaded = load_model(model, dtype=torch.float16)
        if args.policy:
            policies = {f"custom{n}": json.loads(p) for n, p in enumerate(args.policy)}
        else:
            policies = {k: v for k, v in SUITES[model].items() if not args.only or k in args.only}
        results = []
        for name, fields in policies.items():
            res = run_one(loaded, name, Policy.from_dict(fields), args)
            results.append(res)
            brief = {k: res.get(k) for k in ("name", "ok", "tokens_per_s", "prefill_s", "decode_s", "peak_device_bytes",
                                             "error")}
            print(json.dumps(brief), flush=True)
            best = max((r for r in results if r.get("ok")), key=lambda r: r["tokens_per_s"], default={})
            record.update(tokens_per_s=best.get("tokens_per_s"), peak_device_gib=best.get("peak_device_gib"),
                          best=best.get("name"), results=results)
            save_record(out, record, indent=1)


if __name__ == "__main__":
    main()
