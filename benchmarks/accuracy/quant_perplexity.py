"""Perplexity of SmolLM2 with 4-bit weights and KV cache against uncompressed, through the real executor.

Text: passages built from `sample_data/` (support-ticket subjects and bodies, invoice e-mails), each record
on its own line, consecutive records concatenated until a passage holds `--context + --scored` tokens.
Teacher forcing through the decode loop: each passage's first `--context` tokens are the prompt (prefilled
into the possibly compressed cache), then a selector feeds back the true next token while summing its
log-probability, so every scored token attends over the compressed KV cache exactly as in generation.
Besides perplexity, each variant reports the mean KL divergence (nats per token) of its next-token
distribution from the uncompressed one on the same tokens: a lower-noise measure of the damage.

SmolLM2's embedded weights are already llama.cpp Q4_1 (4-bit, groups of 32 along the input dim), so
weights re-quantized in groups of 32 land on that grid; groups of 64 do not. Variants (`--variants`, names
below) cover weights, cache and both, with and without the Hadamard rotation (`QuantConfig.rotate`), and
with the output head also 4-bit (`*_head4`: a what-if; the engine keeps every family's lm_head dense,
because SmolLM2's lm_head is its tied embedding, stored as Q8_0 in the GGUF, not on a 4-bit grid).
Appends one record (common fields; per variant perplexity, KL, relative change) to
benchmarks/records/<machine>/quant_perplexity.jsonl (or --out); the target: both compressed within 5% of
uncompressed.

    python benchmarks/accuracy/quant_perplexity.py [--dtype float32] [--variants all|name,name] [--out FILE]
    python benchmarks/accuracy/quant_perplexity.py --passages 1 --context 16 --scored 4 --variants both_defaults --out /tmp/q.jsonl

The default variants run in about 8 minutes on a 2-core CPU.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import ROOT, Timer, add_record_args, new_record, save_record  # noqa: E402

import torch  # noqa: E402

from engine.models.loader import load_model  # noqa: E402
from engine.policy.policy import Policy  # noqa: E402
from engine.quant.config import CACHE_QUANT, GGUF_WEIGHT_QUANT, WEIGHT_QUANT, QuantConfig  # noqa: E402
from engine.runtime.executor import Executor  # noqa: E402

BENCHMARK, WORKLOAD = "quant_perplexity", "sample-text"
G64, G32 = QuantConfig(group_size=64), QuantConfig(group_size=32)
G64R, G32R = QuantConfig(group_size=64, rotate=True), QuantConfig(group_size=32, rotate=True)
VARIANTS: dict[str, tuple[QuantConfig | None, QuantConfig | None, bool]] = {
    # name: (weights, cache, head4); None = dense; head4 also compresses lm_head (a what-if: the engine keeps
    # the output head dense; SmolLM2's lm_head is its tied embedding, stored as Q8_0 in the GGUF)
    "uncompressed": (None, None, False),
    "cache_g64": (None, G64, False),
    "cache_g32": (None, G32, False),
    "cache_g64_rot": (None, G64R, False),
    "cache_g32_rot": (None, G32R, False),
    "weights_g64": (G64, None, False),
    "weights_g32": (G32, None, False),
    "weights_g32_rot": (G32R, None, False),
    "weights_g32_head4": (G32, None, True),
    "both_g64": (G64, G64, False),
    "both_w_g32_cache_g64_rot": (G32, G64R, False),
    "both_w_g32_cache_g32_rot": (G32, G32R, False),
    "both_defaults": (GGUF_WEIGHT_QUANT, CACHE_QUANT, False),          # the model is a GGUF: its weight groups
    "both_defaults_head4": (GGUF_WEIGHT_QUANT, CACHE_QUANT, True),
}
DEFAULT_VARIANTS = ["cache_g64", "cache_g32", "cache_g64_rot", "cache_g32_rot", "weights_g64", "weights_g32",
                    "weights_g32_head4", "both_g64", "both_defaults", "both_defaults_head4"]
SOURCES = {   # file: how a record becomes one line of text
    "tickets.csv": lambda r: f"{r['subject']}: {r['body']}",
    "invoices.csv": lambda r: r["body"],
}


def passages(tokenize, n_per_source: int, length: int) -> list[list[int]]:
    """`n_per_source` passages of exactly `length` tokens from each sample_data source, records in file order."""
    out = []
    for name, render in SOURCES.items():
        with open(ROOT / "sample_data" / name, newline="", encoding="utf-8") as f:
            lines = [render(r) for r in csv.DictReader(f)]
        ids: list[int] = []
        for line in lines:
            ids += tokenize(line + "\n")
            if len(ids) >= length:
                out.append(ids[:length])
                ids = []
                if len(out) % n_per_source == 0:
                    break
        else:
            raise ValueError(f"sample_data/{name}: too little text for {n_per_source} passages of {length} tokens")
    return out


class TeacherForcing:
    """TokenSelector feeding back the true continuation, summing its NLL and the KL from a reference run.

    `reference` (row -> [scored, vocab] log-probs of the uncompressed run) turns on the KL sum; with
    `keep=True` the selector records its own log-probs to serve as a later run's reference.
    """

    def __init__(self, targets: list[list[int]], reference: dict | None = None, keep: bool = False):
        self.targets, self.pos = targets, [0] * len(targets)
        self.reference, self.kept = reference, ({} if keep else None)
        self.nll, self.kl, self.count = 0.0, 0.0, 0

    def __call__(self, rows, logits):
        logp = torch.log_softmax(logits.float(), dim=-1)                   # [n, vocab]
        out = []
        for n, r in enumerate(rows):
            t = self.pos[r]
            tok = self.targets[r][t]
            self.nll -= float(logp[n, tok])
            if self.reference is not None:
                ref = self.reference[r][t]                                 # [vocab]
                self.kl += float((ref.exp() * (ref - logp[n])).sum())
            if self.kept is not None:
                self.kept.setdefault(r, []).append(logp[n].clone())
            self.count += 1
            self.pos[r] += 1
            out.append(tok)
        return out, [False] * len(rows)


class Head4:
    """A model family whose `layer_specs` mark the head's matmul weight (lm_head) quantizable."""

    def __init__(self, family):
        self._family = family

    def __getattr__(self, name):
        return getattr(self._family, name)

    def layer_specs(self):
        def packed(spec):
            weights = {n: dataclasses.replace(w, quantizable=len(w.shape) == 2) for n, w in spec.weights.items()}
            return dataclasses.replace(spec, weights=weights)

        return [packed(s) if s.kind == "head" else s for s in self._family.layer_specs()]


def run(loaded, prompts, targets, dtype, weights, cache, head4=False, reference=None,
        keep=False) -> tuple[dict, TeacherForcing]:
    if head4:
        loaded = dataclasses.replace(loaded, family=Head4(loaded.family))
    policy = Policy(gpu_batch_size=len(prompts), compress_weights=weights is not None, compress_cache=cache is not None)
    ex = Executor(loaded, policy, device=torch.device("cpu"), dtype=dtype,
                  quant_config=weights, cache_quant_config=cache or CACHE_QUANT)
    sel = TeacherForcing(targets, reference, keep)
    try:
        with Timer() as clock:
            ex.generate_block(prompts, [len(t) for t in targets], sel)
    finally:
        ex.close()
    cfg = {f: (None if q is None else {"group_size": q.group_size, "rotate": q.rotate}) for f, q in
           (("weights", weights), ("cache", cache))}
    cfg["head4"] = head4
    res = {"perplexity": math.exp(sel.nll / sel.count), "tokens": sel.count, **cfg,
           "seconds": round(clock.seconds, 1)}
    if reference is not None:
        res["mean_kl_nats"] = sel.kl / sel.count
    return res, sel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--passages", type=int, default=8, help="passages per sample_data source")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per passage")
    ap.add_argument("--scored", type=int, default=48, help="tokens scored per passage, after the prompt")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"'all' or a comma-separated subset of {list(VARIANTS)}")
    add_record_args(ap)
    args = ap.parse_args()
    record = new_record(BENCHMARK, WORKLOAD, args.model, device="cpu", commit=args.commit)
    total = Timer.started()
    from tokenizers import Tokenizer

    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    dtype = getattr(torch, args.dtype)
    loaded = load_model(args.model, dtype=dtype)
    tok = Tokenizer.from_file(str(Path(loaded.tokenizer_dir) / "tokenizer.json"))
    ids = passages(lambda s: tok.encode(s, add_special_tokens=False).ids, args.passages, args.context + args.scored)
    prompts = [x[:args.context] for x in ids]
    targets = [x[args.context:] for x in ids]
    base, ref = run(loaded, prompts, targets, dtype, None, None, keep=True)
    results = {"uncompressed": base}
    print("uncompressed", base, file=sys.stderr, flush=True)
    reference = {r: torch.stack(v) for r, v in ref.kept.items()}         # row -> [scored, vocab]
    for name in names:
        if name == "uncompressed":
            continue
        results[name], _ = run(loaded, prompts, targets, dtype, *VARIANTS[name], reference=reference)
        results[name]["relative_change"] = results[name]["perplexity"] / base["perplexity"] - 1
        print(name, results[name], file=sys.stderr, flush=True)
    base["relative_change"] = 0.0
    record.update({
        "dtype": args.dtype,
        "text": f"sample_data {list(SOURCES)}: {len(ids)} passages, {args.context} prompt + {args.scored} scored "
                "tokens each, teacher-forced through Executor decode",
        "quant": "4-bit asymmetric, min/scale float32 (float16 for half dtypes); rotate = normalized Hadamard per group",
        "defaults": {"WEIGHT_QUANT": repr(WEIGHT_QUANT), "GGUF_WEIGHT_QUANT": repr(GGUF_WEIGHT_QUANT),
                     "CACHE_QUANT": repr(CACHE_QUANT)},
        "results": results,
        "within_5_percent": {n: abs(r["relative_change"]) <= 0.05 for n, r in results.items()},
        "total_seconds": round(total.elapsed, 1),
    })
    save_record(record, args.out)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
