"""Per-policy timings of policy_validation records, from the numbers the records already hold.

For each measured policy of each model: predicted and measured (steady) tokens/s, the block's wall-time
tokens/s, and decode milliseconds per layer-step and per (layer, GPU batch) slot, measured and predicted;
then per model the Spearman rank correlation (predicted vs steady) over the grid policies of every file and the
autos of the first, and each file's autos' steady / the best grid policy's. A file is a records file (every
policy_validation record in it) or one JSON record. Policies copied by `--grid-from` (they name a `source`)
are skipped, so list the grid's file too, after the file whose autos count. Prints a table (stdout); it
measures nothing and writes no file.

    python benchmarks/policy/policy_report.py benchmarks/records/h200/policy_validation.jsonl
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import read_records  # noqa: E402
from engine.models.hf_config import config_from_hf  # noqa: E402
from engine.models.presets import PRESETS  # noqa: E402
from benchmarks.policy.policy_validation import spearman, steady_tokens_per_s  # noqa: E402


def rows(path: Path) -> list[dict]:
    """One dict per measured, not copied, policy of every model of every record in `path`."""
    out = []
    entries = [item for rec in read_records(path) for item in rec.get("models", {}).items()]
    for model, entry in entries:
        layers, gen = config_from_hf(PRESETS[model]).num_hidden_layers, entry["gen_len"]
        for r in entry["policies"]:
            if "executor_stats" not in r or r.get("source"):
                continue
            p, st = r["policy"], r["executor_stats"]
            k, steps = p["num_gpu_batches"], max(1, st["steps"] - 1)
            step_ms = 1e3 * st["decode_s"] / steps / layers
            out.append({
                "file": path.name, "model": model, "name": r["names"][0], "auto": r["names"][0].startswith("auto"),
                "predicted": r["predicted_tokens_per_s"],
                "steady": steady_tokens_per_s(r, p["gpu_batch_size"] * k, gen),
                "wall": r.get("wall_tokens_per_s", r["measured_tokens_per_s"]),
                "decode_ms_per_layer_step": step_ms, "decode_ms_per_slot": step_ms / k,
                "predicted_decode_ms_per_layer_step": 1e3 * r["predicted_decode_s"] / max(1, gen - 1) / layers,
            })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args()
    table = [row for f in args.files for row in rows(f)]
    for r in table:
        print(f"{r['file'][:30]:30s} {r['model']:8s} {r['name'][:38]:38s} pred {r['predicted']:7.1f} "
              f"steady {r['steady']:7.1f} wall {r['wall']:7.1f}  decode ms/layer-step {r['decode_ms_per_layer_step']:6.2f} "
              f"(pred {r['predicted_decode_ms_per_layer_step']:6.2f}), per slot {r['decode_ms_per_slot']:6.2f}")
    for model in sorted({r["model"] for r in table}):
        grid = [r for r in table if r["model"] == model and not r["auto"]]
        if not grid:
            continue
        best = max(r["steady"] for r in grid)
        ranked = grid + [r for r in table if r["model"] == model and r["auto"] and r["file"] == args.files[0].name]
        print(f"{model}: spearman {spearman([r['predicted'] for r in ranked], [r['steady'] for r in ranked])} "
              f"over {len(ranked)} policies")
        for r in table:
            if r["model"] == model and r["auto"]:
                print(f"  {r['file']} {r['name']}: {r['steady'] / best:.3f} of the best grid policy ({best:.1f})")


if __name__ == "__main__":
    main()
