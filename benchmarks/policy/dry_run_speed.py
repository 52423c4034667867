"""How long `llmops run --dry-run` takes to print a job's plan, for every model preset, from a fresh process.

For each preset (`engine.models.presets.PRESETS`, dummy weights; `--presets` to choose) runs
`llmops run PIPELINE --dry-run --model PRESET --set engine.gpu_memory=GPU_MEMORY` in a fresh Python process
with the plan cache emptied first, so every run plans its job (the hardware profile stays cached, as it is on
a machine that ran anything before: an unrecorded warm-up run measures it when it is not), and times it from
the shell's side: interpreter start, imports, the model's config, planning and printing (the modules
byte-compiled first, `benchmarks.operators.invoice_job.run_llmops`). A preset no policy fits under the budget
on this machine says so (its `error`: the dry run's note). One record (common fields; `presets`: per preset
the seconds, the plan's block shape and weight/cache fractions, or the error; `max_seconds`; `all_planned`)
appended to benchmarks/records/<machine>/dry_run_speed.jsonl (or --out).

    python benchmarks/policy/dry_run_speed.py [--pipeline pipelines/bench_invoices.yaml] [--gpu-memory 16GiB]
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import ROOT, Timer, add_record_args, new_record, save_record  # noqa: E402
from benchmarks.operators.invoice_job import run_llmops  # noqa: E402

from engine.calibrate.planning.cache import plan_dir  # noqa: E402
from engine.models.presets import PRESETS  # noqa: E402


def dry_run(pipeline: Path, preset: str, gpu_memory: str) -> dict:
    """One `llmops run --dry-run` of `preset` in a fresh process, the plan cache emptied first: its seconds and
    the plan it printed (or the error)."""
    shutil.rmtree(plan_dir(), ignore_errors=True)
    argv = ["run", str(pipeline), "--dry-run", "--json", "--model", preset, "--set", f"engine.gpu_memory={gpu_memory}"]
    try:
        with Timer() as t:
            shown, _, _ = run_llmops(argv, f"llmops run --dry-run --model {preset}")
    except RuntimeError as exc:
        return {"seconds": round(t.seconds, 2), "error": str(exc)[-800:]}
    plan = shown.get("job_plan")
    if not plan:
        return {"seconds": round(t.seconds, 2), "error": shown.get("policy_note") or "no plan shown"}
    policy = plan.get("policy") or {}
    return {"seconds": round(t.seconds, 2), "planning_s": plan.get("planning_s"),
            "block": f"{policy.get('gpu_batch_size')}x{policy.get('num_gpu_batches')}",
            "w_gpu": policy.get("w_gpu"), "cache_gpu": policy.get("cache_gpu"),
            "compress_weights": policy.get("compress_weights"), "device": plan.get("device_name")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipeline", type=Path, default=ROOT / "pipelines" / "bench_invoices.yaml")
    ap.add_argument("--gpu-memory", default="16GiB")
    ap.add_argument("--presets", default=",".join(p for p in PRESETS if not p.startswith("tiny-")),
                    help="comma-separated preset names (default: every full-size preset)")
    add_record_args(ap)
    args = ap.parse_args(argv)
    names = args.presets.split(",")
    dry_run(args.pipeline, names[0], args.gpu_memory)      # warm-up: measures the hardware profile if not cached
    presets = {}
    for name in names:
        presets[name] = dry_run(args.pipeline, name, args.gpu_memory)
        got = presets[name]
        print(f"{name:18s} {got['seconds']:6.2f} s  {got.get('block') or got.get('error', '')[-200:]}", flush=True)
    record = new_record("dry_run_speed", args.pipeline.stem, None, gpu_memory=args.gpu_memory)
    record["presets"] = presets
    record["max_seconds"] = max(p["seconds"] for p in presets.values())
    record["all_planned"] = all("error" not in p for p in presets.values())
    save_record(record, args.out)
    return 0 if record["all_planned"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
