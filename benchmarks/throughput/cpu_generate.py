"""CPU throughput: our engine vs transformers' `generate` on SmolLM2-135M-Instruct, same prompts, per dtype.

Each side runs at its best batch size from a small sweep; prompts (>= 256, varied lengths, chat-templated
row texts: invoices, addresses, tickets) are sorted by length for both, so neither pays more padding than
it must. Tokens are counted honestly: both stop a row at EOS, and only tokens produced up to and including
the first EOS count (transformers keeps computing finished rows of a batch: that cost is its own).
Appends one record (the common fields; tokens_per_s = our best; per dtype tokens/s each side, ratio, batch
sizes; peak RSS) to benchmarks/records/<machine>/cpu_generate.jsonl (or --out; `make bench`).

    python benchmarks/throughput/cpu_generate.py [--prompts 256] [--ours 16,64,128,256] [--hf 16,64] [--dtypes bfloat16,float32]
    python benchmarks/throughput/cpu_generate.py --prompts 8 --ours 8 --hf 8 --dtypes float32 --max-new-tokens 4 --out /tmp/g.jsonl
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import ROOT, Timer, add_record_args, new_record, save_record  # noqa: E402
from engine import LLM, Policy, SamplingParams  # noqa: E402
from engine.models.aliases import resolve_alias  # noqa: E402
from engine.decoding.prompts import encode_prompts  # noqa: E402

STREETS = ["Main Street", "Baker Street", "Rue de Rivoli", "Hauptstrasse", "Elm Avenue", "Via Roma", "Calle Mayor"]
CITIES = [("London", "NW1 6XE"), ("Paris", "75001"), ("Berlin", "10115"), ("Springfield", "62701"),
          ("Rome", "00184"), ("Madrid", "28013"), ("Toronto", "M5V 2T6"), ("Osaka", "530-0001")]
ISSUES = ["the app crashes when I press save", "I was charged twice for my subscription",
          "the invoice shows the wrong VAT number", "my password reset email never arrives",
          "the export to CSV hangs at 99 percent", "please cancel my order before it ships",
          "the dashboard is blank after the last update", "can I change the billing address on my account"]
BENCHMARK, WORKLOAD, MODEL = "cpu_generate", "sample-prompts", "smollm2-135m-instruct"
TASKS = ["Extract the city from this address: {}", "Classify this support ticket as bug, billing or other: {}",
         "Extract the invoice number and total amount as JSON: {}", "Summarize in one short sentence: {}"]


def builtin_rows(n: int, seed: int = 0) -> list[str]:
    """Realistic table rows (addresses, tickets, invoices) of varied length, deterministic."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        kind = i % 3
        city, zip_code = rng.choice(CITIES)
        if kind == 0:
            rows.append(f"{rng.randint(1, 999)} {rng.choice(STREETS)}, {zip_code} {city}")
        elif kind == 1:
            extra = " ".join(rng.sample(ISSUES, rng.randint(0, 3)))
            rows.append(f"Ticket #{rng.randint(1000, 99999)}: {rng.choice(ISSUES)}. {extra}".strip())
        else:
            items = "; ".join(f"{rng.randint(1, 9)} x item-{rng.randint(10, 99)} at {rng.uniform(1, 90):.2f} EUR"
                              for _ in range(rng.randint(1, 6)))
            rows.append(f"Invoice INV-{rng.randint(10000, 99999)} to {city}: {items}. Total due in 30 days.")
    return rows


FILE_TASKS = {  # sample_data file -> instruction over its (non-label) columns
    "invoices.csv": "Extract the invoice number, total amount and due date from: {body}",
    "tickets.csv": "Classify this support ticket as bug, billing or other: {subject}. {body}",
    "addresses.csv": "Extract the city from this address: {address}",
    "customers_messy.csv": "Clean this customer record: name {name}, city {city}, signup {signup_date}, phone {phone}",
    "products_pairs.csv": ("Do these listings describe the same product? Answer match or no_match. "
                           "A: {left_title} ({left_price}) B: {right_title} ({right_price})"),
}


def csv_prompts(folder: Path, n: int) -> list[str]:
    """Up to n prompts from sample_data/*.csv, the files' rows interleaved (round-robin)."""
    per_file = []
    for name, task in FILE_TASKS.items():
        path = folder / name
        if path.is_file():
            with path.open(newline="", encoding="utf-8") as f:
                per_file.append([task.format_map(record) for record in csv.DictReader(f)])
    mixed = [rows[i] for i in range(max(map(len, per_file), default=0)) for rows in per_file if i < len(rows)]
    return mixed[:n]


def build_prompts(n: int) -> tuple[list[str], str]:
    """n instruction prompts over table rows: sample_data/*.csv first, built-in rows for the rest."""
    prompts = csv_prompts(ROOT / "sample_data", n)
    source = "sample_data/*.csv" if prompts else "built-in rows"
    if prompts and len(prompts) < n:
        source = "sample_data/*.csv + built-in rows"
    rows = builtin_rows(n - len(prompts))
    return prompts + [TASKS[i % len(TASKS)].format(row) for i, row in enumerate(rows)], source


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours(prompts: list[str], batch: int, max_new: int, dtype: str) -> dict:
    with LLM(MODEL, dtype=dtype, device="cpu", policy=Policy(gpu_batch_size=batch)) as llm:
        llm.generate(prompts[:batch][:8], SamplingParams(max_new_tokens=4))  # warm-up
        with Timer() as t:
            out = llm.generate(prompts, SamplingParams(max_new_tokens=max_new))
    tokens = sum(len(c.token_ids) for c in out)
    return {"batch_size": batch, "tokens": tokens, "seconds": t.seconds, "tokens_per_s": tokens / t.seconds}


def run_hf(model, tok, prompt_ids: list[list[int]], batch: int, max_new: int, eos: set[int]) -> dict:
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    tokens = 0
    with Timer() as clock:
        for s in range(0, len(order), batch):
            chunk = [prompt_ids[i] for i in order[s:s + batch]]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in chunk])              # [b, s]
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])              # [b, s]
            with torch.inference_mode():
                new = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                     pad_token_id=tok.pad_token_id)[:, width:].tolist()
            for row in new:
                stop = next((k for k, t in enumerate(row) if t in eos), None)
                tokens += len(row) if stop is None else stop + 1
    return {"batch_size": batch, "tokens": tokens, "seconds": clock.seconds, "tokens_per_s": tokens / clock.seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--ours", default="16,64,128,256", help="our batch sizes to sweep")
    ap.add_argument("--hf", default="16,64", help="transformers batch sizes to sweep")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="dtypes to compare (both sides, each)")
    add_record_args(ap)
    args = ap.parse_args()
    record = new_record(BENCHMARK, WORKLOAD, MODEL, device="cpu", commit=args.commit)
    torch.manual_seed(0)
    prompts, source = build_prompts(args.prompts)

    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    probe = LLM(MODEL, dtype="float32", device="cpu")
    folder, our_tok = probe.loaded.tokenizer_dir, probe.tokenizer   # the model cache: config + tokenizer only
    gguf = resolve_alias(MODEL)                   # transformers reads the GGUF itself
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    prompt_ids = [e.ids for e in encode_prompts(prompts, params, our_tok, probe.config.vocab_size, probe.max_context)]
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token=our_tok.eos_token,
                                  pad_token=our_tok.eos_token)
    eos = set(probe.eos_token_ids)
    per_dtype = {}
    for dtype in args.dtypes.split(","):
        ours = [run_ours(prompts, int(b), args.max_new_tokens, dtype) for b in args.ours.split(",")]
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=getattr(torch, dtype)).eval()
        hf = [run_hf(model, tok, prompt_ids, int(b), args.max_new_tokens, eos) for b in args.hf.split(",")]
        del model
        best_ours = max(ours, key=lambda r: r["tokens_per_s"])
        best_hf = max(hf, key=lambda r: r["tokens_per_s"])
        per_dtype[dtype] = {"ours": {"best": best_ours, "sweep": ours}, "transformers": {"best": best_hf, "sweep": hf},
                            "ratio": best_ours["tokens_per_s"] / best_hf["tokens_per_s"]}
    best_ours = max((d["ours"]["best"]["tokens_per_s"], k) for k, d in per_dtype.items())
    best_hf = max((d["transformers"]["best"]["tokens_per_s"], k) for k, d in per_dtype.items())
    lengths = [len(p) for p in prompt_ids]
    result = {
        **record, "tokens_per_s": best_ours[0], "max_new_tokens": args.max_new_tokens,
        "token_count": "generated tokens up to and including EOS, both sides stop at EOS",
        "prompts": len(prompts), "prompt_source": source,
        "prompt_tokens": {"min": min(lengths), "mean": sum(lengths) / len(lengths), "max": max(lengths)},
        "per_dtype": per_dtype,
        "best_vs_best": {"ours_tokens_per_s": best_ours[0], "ours_dtype": best_ours[1],
                         "transformers_tokens_per_s": best_hf[0], "transformers_dtype": best_hf[1],
                         "ratio": best_ours[0] / best_hf[0]},
        "peak_rss_mib_process": peak_rss_mib(), "load_average": os.getloadavg(),
    }
    save_record(result, args.out)
    sys.stdout.write(json.dumps({"per_dtype_ratio": {k: d["ratio"] for k, d in per_dtype.items()},
                                 "best_vs_best": result["best_vs_best"]}) + "\n")


if __name__ == "__main__":
    main()
