"""Micro-benchmark: the routed experts of one sparse-MoE layer, a loop per expert against the grouped path of
`engine.models.moe.moe_experts`, with two alternatives to the engine's grouping.

Variants, each on the same x [n, h], routing and stacked weights w1/w3 [E, i, h], w2 [E, h, i]:
  loop         a loop per expert: one stable sort, then per expert with tokens a gather, three linears,
               the activation, the product and a weighted index_add (~8 launches per expert)
  grouped      `engine.models.moe.moe_experts` as on an accelerator: groups of consecutive experts spanning
               those without tokens (`gaps`), padded to the largest count, three bmm against views of the
               weights, EXPERT_GROUP_BYTES a group
  hit_runs     the same with groups of experts with tokens only (`gaps=False`)
  per_expert   `moe_experts` with CPU_GROUP_BYTES (its default on a CPU device): one expert per group
  all_experts  one padded bmm over all E experts, experts without tokens included (their weights read, their
               padded rows computed)
  hit_experts  one padded bmm over the experts with tokens only, their weights copied by index_select
Routing: softmax top-k of random router logits (about uniform over experts). Times are medians over --repeat
rounds, the variants interleaved in each round, after one warm-up call each; wall clock around each call
(torch.cuda.synchronize before and after on CUDA, so the one host sync inside and every launch count).
Each case also records the experts hit, the engine's groups, padded rows over real (token, expert) pairs,
aten ops per call (a TorchDispatchMode count: about the kernel launches), and every variant's largest
difference to the loop relative to the loop's largest value.
Appends one record (common fields, a row per shape and token count; workload: the shapes joined by "+", then
the dtype) to benchmarks/records/<machine>/moe_experts_speed.jsonl (or --out).

    python benchmarks/kernels/moe_experts_speed.py                        # GPU: the three shapes, 16/192/512/4096 tokens
    python benchmarks/kernels/moe_experts_speed.py --shape qwen3-30b-a3b --tokens 192,512 --repeat 3 --threads 1   # CPU
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import Timer, add_record_args, new_record, save_record, torch_device  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from engine.models.hf_config import config_from_hf  # noqa: E402
from engine.models.layers import linear  # noqa: E402
from engine.models.moe import (  # noqa: E402
    CPU_GROUP_BYTES, EXPERT_GROUP_BYTES, expert_groups, expert_slot_bytes, moe_experts,
)
from engine.models.presets import PRESETS  # noqa: E402

SHAPES = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite")


def loop_experts(x, top_w, top_e, w1, w2, w3, act):
    """`moe_experts` before the grouped path (the baseline): one sort, then a loop over the experts."""
    out = torch.zeros_like(x)  # [n, h]
    k = top_e.shape[1]
    flat = top_e.flatten()  # [n*k]
    order = torch.sort(flat, stable=True).indices  # [n*k] grouped by expert
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    start = 0
    for e, count in enumerate(counts):
        pick, start = order[start:start + count], start + count  # [m] flat (token, slot) indices
        if count == 0:
            continue
        token, slot = pick // k, pick % k  # [m], [m]
        h = x[token]  # [m, h]
        y = linear(act(linear(h, w1[e])) * linear(h, w3[e]), w2[e])  # [m, h]
        out.index_add_(0, token, (y * top_w[token, slot, None]).to(out.dtype))
    return out


def one_bmm_experts(x, top_w, top_e, w1, w2, w3, act, hit_only: bool):
    """One padded bmm over all experts, or (`hit_only`) over the experts with tokens, weights index_selected."""
    n, h = x.shape
    k, E = top_e.shape[1], w1.shape[0]
    flat = top_e.reshape(-1)  # [n*k]
    experts, order = torch.sort(flat, stable=True)  # [n*k] x 2
    counts = torch.bincount(flat, minlength=E)  # [E]
    host = counts.tolist()
    c = max(host, default=0)
    if c == 0:
        return torch.zeros_like(x)
    rank = torch.arange(n * k, device=x.device) - (counts.cumsum(0) - counts)[experts]  # [n*k]
    if hit_only:
        hit = [e for e, m in enumerate(host) if m]
        index = torch.tensor(hit, device=x.device)
        slot_of = torch.zeros(E, dtype=torch.int64, device=x.device).index_copy_(
            0, index, torch.arange(len(hit), device=x.device))  # [E] expert -> its place among the hit
        w1, w2, w3 = (w.index_select(0, index) for w in (w1, w2, w3))  # [G, ...] copies
        experts = slot_of[experts]
    g = w1.shape[0]
    dest = experts * c + rank  # [n*k]
    token = order // k
    xp = x.new_zeros(g * c, h).index_copy_(0, dest, x[token]).view(g, c, h)  # [g, c, h]
    a = act(torch.bmm(xp, w1.transpose(1, 2))) * torch.bmm(xp, w3.transpose(1, 2))  # [g, c, i]
    y = torch.bmm(a, w2.transpose(1, 2)).view(g * c, h)[dest]  # [n*k, h]
    out = torch.zeros_like(x)
    return out.index_add_(0, token, (y * top_w.reshape(-1)[order, None]).to(x.dtype))


class OpCount(TorchDispatchMode):
    """Counts aten ops dispatched while active (about the kernel launches of a call)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _seconds(fns: dict[str, Callable[[], object]], device: torch.device, repeat: int) -> dict[str, float]:
    """Median wall seconds per call of each fn over `repeat` rounds, the variants interleaved round by round
    (a shared host's load drifts alike over all of them), after one warm-up call each."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            sync()
            with Timer() as t:
                fn()
                sync()
            times[name].append(t.seconds)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _case(name: str, tokens: int, dtype: torch.dtype, device: torch.device, repeat: int,
          variants: list[str]) -> dict:
    c = config_from_hf(PRESETS[name])
    E, k, h, i = c.num_local_experts, c.num_experts_per_tok, c.hidden_size, c.expert_intermediate_size
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, h, generator=g, device=device, dtype=dtype)
    w1, w3 = (torch.randn(E, i, h, generator=g, device=device, dtype=dtype) * h ** -0.5 for _ in range(2))
    w2 = torch.randn(E, h, i, generator=g, device=device, dtype=dtype) * i ** -0.5
    probs = torch.softmax(torch.randn(tokens, E, generator=g, device=device), dim=-1)  # [n, E]
    top_w, top_e = torch.topk(probs, k, dim=-1)  # [n, k]
    top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    fns = {"loop": lambda: loop_experts(x, top_w, top_e, w1, w2, w3, F.silu),
           "grouped": lambda: moe_experts(x, top_w, top_e, w1, w2, w3, F.silu, group_bytes=EXPERT_GROUP_BYTES,
                                          gaps=True),
           "hit_runs": lambda: moe_experts(x, top_w, top_e, w1, w2, w3, F.silu, group_bytes=EXPERT_GROUP_BYTES,
                                           gaps=False),
           "per_expert": lambda: moe_experts(x, top_w, top_e, w1, w2, w3, F.silu, group_bytes=CPU_GROUP_BYTES),
           "all_experts": lambda: one_bmm_experts(x, top_w, top_e, w1, w2, w3, F.silu, hit_only=False),
           "hit_experts": lambda: one_bmm_experts(x, top_w, top_e, w1, w2, w3, F.silu, hit_only=True)}
    counts = torch.bincount(top_e.flatten(), minlength=E).tolist()
    groups = expert_groups(counts, expert_slot_bytes(h, i, x.element_size()), EXPERT_GROUP_BYTES, gaps=True)
    row = {"shape": name, "tokens": tokens, "experts": E, "top_k": k, "hidden": h, "intermediate": i,
           "experts_hit": sum(1 for m in counts if m), "max_count": max(counts), "groups": len(groups),
           "padded_over_pairs": round(sum((e1 - e0) * m for e0, e1, m in groups) / (tokens * k), 3)}
    ref = fns["loop"]().float()
    scale = ref.abs().max().item()
    for variant in variants:
        out = fns[variant]().float()
        with OpCount() as count:
            fns[variant]()
        row[f"{variant}_ops"] = count.ops
        row[f"{variant}_max_rel_diff"] = float(f"{(out - ref).abs().max().item() / scale:.3g}")
    for variant, seconds in _seconds({v: fns[v] for v in variants}, device, repeat).items():
        row[f"{variant}_ms"] = round(seconds * 1e3, 3)
    for variant in variants[1:] if variants[0] == "loop" else []:
        row[f"{variant}_speedup"] = round(row["loop_ms"] / row[f"{variant}_ms"], 2)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", choices=SHAPES, help="model shape (repeatable; default all)")
    ap.add_argument("--tokens", default="16,192,512,4096", help="tokens per call, comma-separated")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on a CPU) | float32 | bfloat16")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default torch's; 1 on a shared host)")
    ap.add_argument("--variants", default="loop,grouped,hit_runs,per_expert,all_experts,hit_experts")
    add_record_args(ap)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch_device(args.device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[args.dtype]
    shapes = args.shape or list(SHAPES)
    variants = args.variants.split(",")
    rows = [_case(name, int(t), dtype, device, args.repeat, variants)
            for name in shapes for t in args.tokens.split(",")]
    workload = "+".join(shapes) + "-" + str(dtype).removeprefix("torch.")
    record = new_record("moe_experts_speed", workload, None, commit=args.commit,
                        device=None if device.type == "cuda" else "cpu")
    record.update(dtype=str(dtype), threads=torch.get_num_threads(), repeat=args.repeat,
                  group_bytes=EXPERT_GROUP_BYTES, results=rows)
    save_record(record, args.out)


if __name__ == "__main__":
    main()
