"""The cost model against what ran: every committed full-size `throughput.py` record of ours, re-predicted.

    python benchmarks/policy/prediction_errors.py                     # benchmarks/records/h200/throughput.jsonl
    python benchmarks/policy/prediction_errors.py F.jsonl ... --json   # other files; one JSON object per line

For each record of system `llmops` that finished (cut models, `--layers`, and several-GPU runs left out) the
policy it ran is costed again by today's `engine.policy.cost_model.estimate` on the h200 reference profile
(the profile `--plan-profile reference` plans with), and its measured prefill and decode step are set beside
the prediction, with the decode channels (seconds per step: the bottleneck's and the others') that the
prediction took its maximum over, and the fraction of today's roofline (`throughput.roofline.record_roofline`: its decode
floor counts the cache GPU attention loads) the run reached. Records of one policy, model and measured decode
step are shown once.
Measures nothing; the records' own `commit` and `run_id` say what code and run each line comes from, so a
ratio mixes today's cost model with that run's engine and machine.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import ROOT, read_jsonl  # noqa: E402
from benchmarks.throughput.roofline import record_roofline  # noqa: E402

from engine.models.hf_config import config_from_hf  # noqa: E402
from engine.models.presets import PRESETS  # noqa: E402
from engine.policy.affine import evaluate  # noqa: E402
from engine.policy.cost_model import Workload, cost_terms, estimate  # noqa: E402
from engine.policy.hardware import HardwareProfile, reference_profile  # noqa: E402
from engine.policy.memory import realized_placement  # noqa: E402
from engine.runtime.layout import model_layout  # noqa: E402
from engine.policy.policy import Policy  # noqa: E402

DEFAULT_FILES = ("benchmarks/records/h200/throughput.jsonl",)


def full_size_runs(records: list[dict]) -> list[dict]:
    """Our finished single-GPU records of a whole preset model (no `--layers` cut), one per (model, policy,
    measured decode step)."""
    out, seen = [], set()
    for r in records:
        ours = r.get("system") == "llmops" and r.get("ok") and r.get("decode_step_s")
        if not ours or r.get("model") not in PRESETS:
            continue
        if (r.get("num_gpus") or 1) != 1:
            continue
        layers = config_from_hf(PRESETS[r["model"]]).num_hidden_layers
        if r.get("num_layers") not in (None, layers):
            continue
        key = (r["model"], json.dumps(r["policy"], sort_keys=True), round(r["decode_step_s"], 3))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def compare(r: dict, profile: HardwareProfile) -> dict:
    """One record's measured prefill / decode step against today's prediction for its policy and workload."""
    config = config_from_hf(PRESETS[r["model"]])
    policy = Policy.from_dict(r["policy"])
    workload = Workload(r["prompt_len"], r["gen_len"], num_prompts=r["num_prompts"],
                        shared_prefix_len=r.get("prefix_len") or 0)
    layout = model_layout(config, 2, policy.compress_weights)
    est = estimate(config, policy, workload, profile, layout=layout)
    terms = cost_terms(config, policy, workload, profile, 2, layout)
    x = realized_placement(config, layout, policy, profile.device_type)
    _, decode = terms.at(x)
    L, steps = config.num_hidden_layers, max(1, r["gen_len"] - 1)
    predicted_step = est.decode_s / steps
    return {
        "model": r["model"], "config_name": r["config_name"], "run_id": r.get("run_id"),
        "commit": (r.get("commit") or {}).get("sha"), "num_gpu_batches": policy.num_gpu_batches,
        "cache_gpu": policy.cache_gpu, "cpu_attention": policy.cpu_attention,
        "measured_prefill_s": r["prefill_s"], "predicted_prefill_s": est.prefill_s,
        "measured_step_s": r["decode_step_s"], "predicted_step_s": predicted_step,
        "step_ratio": r["decode_step_s"] / predicted_step, "prefill_ratio": r["prefill_s"] / est.prefill_s,
        "decode_channels_s": {k: evaluate(v, x) * L for k, v in decode.items() if abs(evaluate(v, x)) > 1e-6},
        "decode_bottleneck": est.decode_bottleneck,
        "roofline_fraction_now": record_roofline(config, r, profile)["floor_s"] / r["total_s"],
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path, help=f"JSONL records (default {', '.join(DEFAULT_FILES)})")
    ap.add_argument("--json", action="store_true", help="one JSON object per record instead of a table")
    args = ap.parse_args(argv)
    files = args.files or [ROOT / f for f in DEFAULT_FILES]
    records = [r for f in files for r in read_jsonl(f)]
    rows = [compare(r, reference_profile("h200")) for r in full_size_runs(records)]
    for row in rows:
        if args.json:
            print(json.dumps(row))
            continue
        channels = ", ".join(f"{k} {v:.3f}" for k, v in row["decode_channels_s"].items())
        print(f"{row['model']:14} {row['config_name']:34} k={row['num_gpu_batches']:<2} cache_gpu="
              f"{row['cache_gpu']:.2f} step {row['measured_step_s']:.3f} / {row['predicted_step_s']:.3f} "
              f"(x{row['step_ratio']:.2f}), prefill {row['measured_prefill_s']:.1f} / {row['predicted_prefill_s']:.1f} "
              f"(x{row['prefill_ratio']:.2f}), roofline fraction {row['roofline_fraction_now']:.2f} | {channels} | "
              f"{row['commit']}")
    return rows


if __name__ == "__main__":
    main()
