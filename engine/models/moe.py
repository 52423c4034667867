"""The routed experts of a sparse-MoE block: top-k routing and the experts' compute, shared by Mixtral, the
Qwen-MoE families and DeepSeek (mixtral.py, qwen2_moe.py, deepseek_v2.py).

Experts are stacked tensors: w1 [E, i, h] (gate), w2 [E, h, i] (down), w3 [E, i, h] (up).

`moe_experts` computes the experts in a few batched launches, not a loop per expert (a decode step of a GPU
batch of 192 tokens hits nearly all of Qwen3-30B-A3B's 128 experts: a loop of ~8 launches per expert made
each (layer, GPU batch) slot launch-bound). The (token, slot) pairs are sorted by expert once; the experts
that received tokens form groups of consecutive experts (`expert_groups`; on an accelerator a group also spans
the experts between them that received none: H200, bf16, Qwen3-30B-A3B's shape at 16 tokens, one bmm over all
128 experts takes 0.73 ms against 3.8 ms for 29 groups of hit experts only, `benchmarks/kernels/moe_experts_speed.py`);
a group of G experts whose largest
count is C gathers its tokens into a zero-padded [G, C, h] and runs the gate, up and down projections as
three `torch.bmm` against views of the stacked weights (no weight is copied; SiLU's act(gate) * up as one
fused pass written into the gate's buffer, `_gate_up`); only the real rows are scaled
by their routing weights and added back (one `index_add_`), so padded rows never reach the output. A group's
padded buffers stay within `group_bytes` (`EXPERT_GROUP_BYTES`: `expert_slot_bytes` per padded row); an
expert whose own tokens exceed it is a group alone (no padding: the per-expert path, for big prefills).
Experts without tokens cost nothing. One host sync per call: the per-expert counts.

On a CPU device the default is one expert per group (`CPU_GROUP_BYTES`): a launch costs microseconds there
against milliseconds of expert compute, so padded rows cost more than the launches they save (2-core CPU, one
thread, float32, Qwen3-30B-A3B / DeepSeek-V2-Lite / Mixtral-8x7B shapes at 16-4096 tokens: grouped 0.75-1.00x
the speed of a loop per expert, one expert per group 0.93-1.13x;
`benchmarks/records/cpu-2core/moe_experts_speed.jsonl`).

With no host sync (`experts_grouped_mm`) where `torch._grouped_mm` has a kernel: bfloat16 on CUDA sm90 and
newer (in torch 2.11-2.13 other dtypes and chips take a fallback that copies the offsets to the host and loops
over groups). The (token, slot) pairs sorted by expert go through the gate, up and down projections as one
grouped matmul each, against views of the stacked weights, with the experts' end offsets on the device, in
chunks of at most `group_bytes` of buffers (`expert_slot_bytes` per pair, no padding); the routing weights
scale the activations in the fused SiLU pass, and each pair's output goes to its (token, slot) place, the k
slots summed once at the end (no atomic `index_add_`). The host then never waits for the device inside a
MoE layer, so it can run ahead of it (with a host sync per layer, the step clock shows the device waiting on
the host in every step of a many-GPU-batch MoE decode on an H200). Checked once per device against the
grouped bmm (`first_use_check`; a failure warns and keeps the grouped bmm). Tested on the CPU (where
`_grouped_mm` runs its reference loop); its kernels measured on an H100:
`benchmarks/records/h100/grouped_mm_speed.jsonl`.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from engine.models.elementwise import silu_mul
from engine.models.layers import linear
from engine.util.kernel_check import first_use_check

EXPERT_GROUP_BYTES = 256 << 20   # padded buffers of one expert group (`expert_slot_bytes` per padded row)
CPU_GROUP_BYTES = 0              # on a CPU device: one expert per group (no padding; module docstring)


def moe_route(x: torch.Tensor, gate: torch.Tensor, top_k: int,
              normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, h], gate [E, h] -> (weights [n, k] float32, experts [n, k] int64). The weights are the softmax
    probabilities of the chosen experts, renormalised to sum 1 per row when `normalize` (Mixtral; Qwen-MoE's
    `norm_topk_prob`)."""
    probs = torch.softmax(linear(x, gate).float(), dim=-1)  # [n, E]
    top_w, top_e = torch.topk(probs, top_k, dim=-1)  # [n, k]
    return (top_w / top_w.sum(dim=-1, keepdim=True) if normalize else top_w), top_e


def expert_slot_bytes(hidden_size: int, intermediate_size: int, element_size: int) -> int:
    """Peak bytes per padded row of an expert group: its input [h] with, at once, the gate activation and the
    up projection [2i], or the down projection and its real rows [2h] (the larger)."""
    return (hidden_size + max(2 * intermediate_size, hidden_size)) * element_size


def expert_groups(counts: list[int], slot_bytes: int, group_bytes: int,
                  gaps: bool = False) -> list[tuple[int, int, int]]:
    """The groups `moe_experts` computes, from the tokens routed to each expert: (e0, e1, C) for experts
    [e0, e1), the first and last with tokens, C the largest count among them. The next expert with tokens
    joins the last group while its padded rows ((e1 - e0) * C) take at most `group_bytes` at `slot_bytes`
    each; an expert over that alone is a group of one (C its own count, no padding). Without `gaps` every
    expert of a group has tokens (an expert without any ends it); with `gaps` a group spans experts without
    tokens too (all-padding rows: their weights are read, no launch is spent on them)."""
    groups: list[tuple[int, int, int]] = []
    last = -2                                        # the last expert with tokens
    for e, count in enumerate(counts):
        if count == 0:
            continue
        if groups and (gaps or e == last + 1):
            e0, _, c = groups[-1]
            wide = max(c, count)
            if (e + 1 - e0) * wide * slot_bytes <= group_bytes:
                groups[-1] = (e0, e + 1, wide)
                last = e
                continue
        groups.append((e, e + 1, count))
        last = e
    return groups


def moe_experts(
    x: torch.Tensor, top_w: torch.Tensor, top_e: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
    w3: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], group_bytes: int | None = None,
    gaps: bool | None = None,
) -> torch.Tensor:
    """Sum over each token's routed experts of weight * w2(act(w1 x) * w3 x). x [n, h], top_w [n, k] (float32),
    top_e [n, k] -> [n, h] in x's dtype; the products with the routing weights are taken in float32.

    In groups of experts (module docstring), each group's padded buffers within `group_bytes` (a single
    expert over it excepted; None: `EXPERT_GROUP_BYTES`, on a CPU device `CPU_GROUP_BYTES`); one host sync
    per call (the per-expert counts), none where `experts_grouped_mm` runs (bfloat16 on CUDA sm90+). `gaps`
    (`expert_groups`; None: on an accelerator, not on a CPU device)."""
    if group_bytes is None:
        group_bytes = CPU_GROUP_BYTES if x.device.type == "cpu" else EXPERT_GROUP_BYTES
    if _sync_free(x, w1):
        return experts_grouped_mm(x, top_w, top_e, w1, w2, w3, act, group_bytes)
    return experts_bmm(x, top_w, top_e, w1, w2, w3, act, group_bytes, gaps)


def experts_bmm(x: torch.Tensor, top_w: torch.Tensor, top_e: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], group_bytes: int,
                gaps: bool | None = None) -> torch.Tensor:
    """`moe_experts`' sum in padded expert groups through `torch.bmm` (module docstring), one host sync."""
    n, h = x.shape
    k, (E, i, _) = top_e.shape[1], w1.shape
    out = torch.zeros_like(x)  # [n, h]
    flat = top_e.reshape(-1)  # [n*k]
    experts, order = torch.sort(flat, stable=True)  # [n*k] x 2: each expert's pairs in ascending token order
    bounds = torch.searchsorted(experts, torch.arange(E + 1, device=x.device))  # [E+1] each expert's first pair
    token = order // k  # [n*k]
    weight = top_w.reshape(-1)[order, None]  # [n*k, 1] float32
    rank = torch.arange(n * k, device=x.device) - bounds[experts]  # [n*k] each pair's place in its expert
    starts = bounds.tolist()  # the one host sync (bincount would add one on CUDA)
    host = [b - a for a, b in zip(starts, starts[1:])]  # tokens per expert
    w1t, w3t, w2t = w1.transpose(1, 2), w3.transpose(1, 2), w2.transpose(1, 2)  # [E, h, i] x 2, [E, i, h] views
    if gaps is None:
        gaps = x.device.type != "cpu"                # launches cost more than reading an idle expert's weights
    for e0, e1, c in expert_groups(host, expert_slot_bytes(h, i, x.element_size()), group_bytes, gaps):
        s0, s1, g = starts[e0], starts[e1], e1 - e0
        tok = token[s0:s1]  # [m] the group's pairs, expert-major
        rows = x.index_select(0, tok)  # [m, h]
        padded = g * c != s1 - s0
        if padded:
            dest = torch.add(rank[s0:s1], experts[s0:s1] - e0, alpha=c)  # [m] row of each pair in [g*c]
            rows = x.new_zeros(g * c, h).index_copy_(0, dest, rows)  # [g*c, h] zero rows for padding
        xp = rows.view(g, c, h)  # [g, c, h]
        del rows
        a = _gate_up(act, lambda: torch.bmm(xp, w1t[e0:e1]), lambda: torch.bmm(xp, w3t[e0:e1]))  # [g, c, i]
        del xp
        y = torch.bmm(a, w2t[e0:e1]).view(g * c, h)  # [g*c, h]
        del a
        y = y.index_select(0, dest) if padded else y  # [m, h] the real rows only
        out.index_add_(0, tok, y.mul_(weight[s0:s1]))
    return out


def experts_grouped_mm(x: torch.Tensor, top_w: torch.Tensor, top_e: torch.Tensor, w1: torch.Tensor,
                       w2: torch.Tensor, w3: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
                       group_bytes: int) -> torch.Tensor:
    """`moe_experts`' sum with no host sync: the pairs sorted by expert, in chunks of at most
    max(1, group_bytes // `expert_slot_bytes`) pairs, each through three `torch._grouped_mm` with the experts'
    end offsets clamped to the chunk (on the device). x [n, h], top_w [n, k] float32, top_e [n, k] -> [n, h].

    Each pair's routing weight scales its activation rows act(w1 x) * w3 x in the fused SiLU pass (float32,
    rounded once more), before the down projection, which is linear: no separate product over the output.
    Each pair's output is copied to its (token, slot) place in a [n, k, h] buffer and the k slots are summed
    once at the end (float32 accumulation, one rounding), instead of an atomic `index_add_` per chunk. The two
    take 86 us and 162 us per 4,096 pairs of Mixtral's shape on an H100, inside the prefill's noise: leaving
    them out moves it by -1.4% on 4 layers and +0.6% on the whole model."""
    n, h = x.shape
    k, (E, i, _) = top_e.shape[1], w1.shape
    pairs = x.new_empty(n * k, h)  # [n*k, h] each pair's weighted output at token * k + slot
    experts, order = torch.sort(top_e.reshape(-1), stable=True)  # [n*k] x 2
    ends = torch.searchsorted(experts, torch.arange(1, E + 1, device=x.device))  # [E] each expert's end pair
    token = order // k  # [n*k]
    weight = top_w.reshape(-1)[order]  # [n*k] float32
    w1t, w3t, w2t = w1.transpose(1, 2), w3.transpose(1, 2), w2.transpose(1, 2)  # [E, h, i] x 2, [E, i, h] views
    rows = max(1, group_bytes // expert_slot_bytes(h, i, x.element_size()))
    for r0 in range(0, n * k, rows):
        r1 = min(n * k, r0 + rows)
        offs = (ends.clamp(r0, r1) - r0).to(torch.int32)  # [E] the chunk's cumulative rows per expert
        xs = x.index_select(0, token[r0:r1])  # [m, h]
        a = _gate_up(act, lambda: torch._grouped_mm(xs, w1t, offs=offs),
                     lambda: torch._grouped_mm(xs, w3t, offs=offs), weight[r0:r1])  # [m, i] weighted
        del xs
        pairs.index_copy_(0, order[r0:r1], torch._grouped_mm(a, w2t, offs=offs))  # [m, h] to their places
        del a
    return pairs.view(n, k, h).sum(dim=1)


def _gate_up(act: Callable[[torch.Tensor], torch.Tensor], gate: Callable[[], torch.Tensor],
             up: Callable[[], torch.Tensor], scale: torch.Tensor | None = None) -> torch.Tensor:
    """act(gate()) * up() from the gate and up projections (thunks), holding at most two buffers of their shape
    (`expert_slot_bytes` counts two): SiLU as one fused pass written into the gate's buffer
    (`elementwise.silu_mul`), any other activation by its output then a product in place. `scale` [m] float32
    multiplies each row (in the same pass for SiLU)."""
    if act is F.silu:
        g = gate()
        return silu_mul(g, up(), out=g, scale=scale)
    y = act(gate()).mul_(up())
    return y if scale is None else y.mul_(scale.unsqueeze(-1))


def _sync_free(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether `moe_experts` takes `experts_grouped_mm` for x [n, h] and w1 [E, i, h]: bfloat16 on a CUDA
    device of compute capability 9.0 or newer whose first-use check passed, h and i multiples of 8 (the
    grouped kernel's 16-byte row alignment)."""
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16 and x.shape[-1] % 8 == 0 and w1.shape[1] % 8 == 0
            and _grouped_mm_ready(x.device.index or 0))


@functools.lru_cache(maxsize=None)
def _grouped_mm_ready(device_index: int) -> bool:
    """Whether cuda:device_index is sm90 or newer and `experts_grouped_mm` matches `experts_bmm` there, found
    once (the check synchronizes that once); a failure or a mismatch warns and the grouped bmm is kept."""
    device = torch.device("cuda", device_index)
    return torch.cuda.get_device_capability(device) >= (9, 0) and first_use_check(
        "moe grouped_mm", str(device), lambda: grouped_mm_self_check(device))


def grouped_mm_self_check(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """True when `experts_grouped_mm` matches `experts_bmm` on `device` for a small routing with an expert
    without tokens, over several chunks; raises RuntimeError naming the error otherwise."""
    g = torch.Generator().manual_seed(0)
    n, h, i, e, k = 40, 64, 128, 8, 2
    x = torch.randn(n, h, generator=g).to(device, dtype)
    w1, w3 = (torch.randn(e, i, h, generator=g).div(h ** 0.5).to(device, dtype) for _ in range(2))
    w2 = torch.randn(e, h, i, generator=g).div(i ** 0.5).to(device, dtype)
    top_e = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(n)]).to(device)
    top_w = torch.rand(n, k, generator=g).to(device)
    args = (x, top_w, top_e, w1, w2, w3, torch.nn.functional.silu)
    got = experts_grouped_mm(*args, 24 * expert_slot_bytes(h, i, x.element_size()))
    want = experts_bmm(*args, EXPERT_GROUP_BYTES)
    scale = want.float().abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    if not err <= 2e-2 * max(scale, 1.0):
        raise RuntimeError(f"experts_grouped_mm differs from the grouped bmm by {err:.3g} "
                           f"(largest value {scale:.3g}) for {dtype}")
    return True
