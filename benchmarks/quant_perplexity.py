"""Perplexity of SmolLM2 with 4-bit weights and KV cache against uncompressed, through the real executor.

Teacher forcing through the decode loop: each passage but its last `--scored` tokens is the prompt (prefilled
into the possibly compressed cache), and a selector feeds back the true next token while summing its
log-probability, so every scored token attends over the compressed KV cache exactly as in generation.
SmolLM2's embedded weights are already llama.cpp Q4_1 (4-bit, groups of 32), so re-quantizing with groups of
64 misaligns the grids; the run also reports groups of 32 (`QuantConfig(group_size=32)`). Writes benchmarks/results/quant_perplexity.json with each
policy's perplexity and the relative change (the target: within 5% of uncompressed).

    python benchmarks/quant_perplexity.py [--dtype bfloat16] [--out benchmarks/results/quant_perplexity.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.models.loader import load_model  # noqa: E402
from engine.policy.policy import Policy  # noqa: E402
from engine.quant.config import QuantConfig  # noqa: E402
from engine.runtime.executor import Executor  # noqa: E402

PASSAGES = [
    "The warehouse on Harbor Street receives about forty deliveries a day. Each pallet is scanned at the dock, "
    "weighed, and assigned a shelf by the inventory system. When a scanner fails, the clerks write the codes by "
    "hand and enter them at the end of the shift, which is why the evening reports are often late. Last winter "
    "the company replaced the old scanners with wireless models, and the number of missing entries fell by half.",
    "Customers who want a refund must contact the support team within thirty days of the purchase. They should "
    "include the order number, the date of the order and a short description of the problem. Most requests are "
    "answered within two business days. If the product was damaged during shipping, a photo of the package helps "
    "the team decide quickly whether to send a replacement or to return the money to the original card.",
    "The city council met on Tuesday evening to discuss the new bicycle lanes. Several residents spoke in favor "
    "of the plan, saying that the lanes would make the streets safer for children riding to school. Others worried "
    "about the loss of parking spaces near the small shops on Main Street. After two hours of debate, the council "
    "agreed to test the lanes for six months and to collect data on traffic before making a final decision.",
    "To bake a simple loaf of bread, mix flour, water, salt and a little yeast in a large bowl. Knead the dough for "
    "about ten minutes until it feels smooth, then cover it and let it rise in a warm place for an hour. Shape the "
    "dough into a loaf, let it rise again, and bake it in a hot oven until the crust is golden brown and the bottom "
    "sounds hollow when tapped. Let the bread cool before cutting it into slices.",
]

POLICIES = {   # name: (policy flags, group size)
    "uncompressed": (dict(), 64),
    "4bit_cache_g64": (dict(compress_cache=True), 64),
    "4bit_weights_and_cache_g64": (dict(compress_weights=True, compress_cache=True), 64),
    "4bit_weights_and_cache_g32": (dict(compress_weights=True, compress_cache=True), 32),
}


class TeacherForcing:
    """TokenSelector feeding back the true continuation and summing its negative log-likelihood."""

    def __init__(self, targets: list[list[int]]):
        self.targets, self.pos = targets, [0] * len(targets)
        self.nll, self.count = 0.0, 0

    def __call__(self, rows, logits):
        logp = torch.log_softmax(logits.float(), dim=-1)
        out = []
        for n, r in enumerate(rows):
            tok = self.targets[r][self.pos[r]]
            self.nll -= float(logp[n, tok])
            self.count += 1
            self.pos[r] += 1
            out.append(tok)
        return out, [False] * len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--scored", type=int, default=24, help="tokens scored at the end of each passage")
    ap.add_argument("--out", default="benchmarks/results/quant_perplexity.json")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    dtype = getattr(torch, args.dtype)
    loaded = load_model(args.model, dtype=dtype)
    tok = Tokenizer.from_file(str(Path(loaded.tokenizer_dir) / "tokenizer.json"))
    ids = [tok.encode(p, add_special_tokens=False).ids for p in PASSAGES]
    prompts = [x[:-args.scored] for x in ids]
    targets = [x[-args.scored:] for x in ids]
    results = {}
    for name, (flags, group) in POLICIES.items():
        ex = Executor(loaded, Policy(gpu_batch_size=len(prompts), **flags), device=torch.device("cpu"), dtype=dtype,
                      quant_config=QuantConfig(group_size=group))
        sel = TeacherForcing(targets)
        t0 = time.perf_counter()
        ex.generate_block(prompts, [len(t) for t in targets], sel)
        ex.close()
        results[name] = {"perplexity": math.exp(sel.nll / sel.count), "tokens": sel.count, "group_size": group,
                         "seconds": time.perf_counter() - t0}
        print(name, results[name], file=sys.stderr, flush=True)
    base = results["uncompressed"]["perplexity"]
    for r in results.values():
        r["relative_change"] = r["perplexity"] / base - 1
    record = {"model": args.model, "dtype": args.dtype, "quant": "4-bit asymmetric, min/scale in float16",
              "results": results, "command": sys.argv,
              "within_5_percent": {n: abs(r["relative_change"]) <= 0.05 for n, r in results.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
