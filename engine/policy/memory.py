"""Memory per tier of a policy: the executor's buffer plan summed, plus the compute's working memory.

`executor_memory` is what the executor reserves against its hard budgets for one full block of
`num_gpu_batches x gpu_batch_size` rows (prompt P, gen n): the bytes per tier of the buffer plan it allocates
from (`buffers.buffer_plan` of the uniform block, `buffer_spec.uniform_block`, and with `Policy.prefill_ahead` over
several blocks the next block's prefill run ahead, `buffers.runs_ahead`), plus on the gpu the working memory
of one GPU batch's compute (`working.working_bytes`; an ahead prefill's pass adds its own). `peak_memory` adds
the device memory the executor uses without reserving it (`untracked_gpu_bytes`: the other GPU batches'
hidden states between layers, an estimate). Nothing here counts a buffer itself: a buffer the runtime
allocates is an entry of the plan, or the runtime refuses it.

`memory_terms` gives the same sums as affine expressions in the placement fractions, for the LP. No buffer of
the plan depends on two tensor classes (weights, cache, hidden states), and within a class each is linear in
the kv heads or hidden features on each tier, so the plan's bytes with one class at a time wholly on the cpu or
on disk (the vertices), weighted by that class's shares, give them; the weights' shares are taken as exact
fractions of bytes between their vertices (on CUDA the held kinds' bytes are a floor of the gpu share,
`ModelLayout.held_fraction`), where whole tensors make the plan a step function. `realized_placement` gives
the fractions of bytes a policy's rounded placement really puts on each tier.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from engine.policy.affine import const, share
from engine.policy.buffer_spec import BufferPlan, uniform_block
from engine.policy.buffers import buffer_plan, runs_ahead
from engine.policy.layout import ModelConfig, ModelLayout
from engine.policy.placement import TIERS, split_ranges
from engine.policy.policy import Policy
from engine.policy.prefix import batch_prefix_len
from engine.policy.working import chunk_rows, rows_per_pass, staged_kv_heads, working_bytes
from engine.quant.config import CACHE_QUANT

_STEP = 1e-6          # a placement fraction just past a tensor's midpoint
__all__ = ["TIERS", "executor_memory", "executor_plan", "memory_terms", "peak_memory", "realized_placement",
           "runs_ahead", "split_fraction_on", "untracked_gpu_bytes", "weight_fraction_on", "weight_settings"]


def executor_plan(config: ModelConfig, layout: ModelLayout, policy: Policy, prompt_len: int, gen_len: int,
                  bytes_per_element: int, device_type: str, *, shared_prefix_len: int = 0,
                  num_prompts: int | None = 1) -> BufferPlan:
    """The buffer plan of one full block of the workload (and, with more than one block and
    `policy.prefill_ahead`, of the next block's prefill run ahead): every buffer the executor allocates."""
    layout = layout.view(bytes_per_element, policy.compress_weights)
    block = uniform_block(policy, prompt_len, gen_len, batch_prefix_len(shared_prefix_len, policy.gpu_batch_size))
    ahead = block if runs_ahead(policy, gen_len, num_prompts) else None
    return buffer_plan(config, layout, policy, block, device_type, ahead=ahead, cache_quant=CACHE_QUANT)


def executor_working_bytes(config: ModelConfig, layout: ModelLayout, policy: Policy, prompt_len: int,
                           gen_len: int, bytes_per_element: int, device_type: str, *, shared_prefix_len: int = 0,
                           num_prompts: int | None = 1) -> int:
    """The device working memory the executor reserves besides its buffers: one GPU batch's compute
    (`working_bytes`, its cache heads not written in place staged for their store), and while an ahead
    prefill runs, one pass of it (`rows_per_pass` rows, every head staged: its gpu share is parked)."""
    g, P, S, cc = policy.gpu_batch_size, prompt_len, prompt_len + gen_len - 1, policy.compress_cache
    prefix = batch_prefix_len(shared_prefix_len, g)
    nkv, experts = config.num_key_value_heads, layout.experts
    staged = staged_kv_heads(nkv, policy.cache_gpu, policy.cache_cpu, device_type, cc)
    work = working_bytes(config, g, P, S, bytes_per_element, cc, staged, prefix_len=prefix, experts=experts)
    if runs_ahead(policy, gen_len, num_prompts):
        per = min(rows_per_pass(policy.block_size, gen_len - 1), g)
        every = staged_kv_heads(nkv, 0.0, 1.0, device_type, cc)
        work += working_bytes(config, per, P, S, bytes_per_element, cc, every, prefix_len=prefix, experts=experts)
    return work


def executor_memory(config: ModelConfig, layout: ModelLayout, policy: Policy, prompt_len: int, gen_len: int,
                    bytes_per_element: int, device_type: str, *, shared_prefix_len: int = 0,
                    num_prompts: int | None = 1) -> dict[str, int]:
    """Peak bytes per tier the executor reserves for one full block (its budgets' accounting), exactly: the
    plan's bytes per tier (`executor_plan`) and, on the gpu, its working memory (`executor_working_bytes`).
    `shared_prefix_len`: the run's shared prompt prefix (`Workload.shared_prefix_len`); `num_prompts` the
    run's rows (None: unbounded)."""
    args = (config, layout, policy, prompt_len, gen_len, bytes_per_element, device_type)
    kw = {"shared_prefix_len": shared_prefix_len, "num_prompts": num_prompts}
    mem = executor_plan(*args, **kw).bytes_on()
    mem["gpu"] += executor_working_bytes(*args, **kw)
    return mem


def _untracked_terms(config: ModelConfig, policy: Policy, prompt_len: int, bytes_per_element: int,
                     device_type: str, shared_prefix_len: int) -> tuple[float, float, float]:
    """(bytes scaled by the gpu share of hidden states, bytes on the device whatever the placement, bytes
    scaled by the share off the gpu) of `untracked_gpu_bytes`."""
    g, K, P, e = policy.gpu_batch_size, policy.num_gpu_batches, prompt_len, bytes_per_element
    p, h, nh = batch_prefix_len(shared_prefix_len, g), config.hidden_size, config.num_attention_heads
    decode = (K - 1) * g * h * e                                # a decode step's hidden [g, 1, h]: never parked
    placed = 0.0 if p else (K - 1) * g * P * h * e - decode     # hidden [g, P, h] parked by the act placement
    kept = (K - 1) * (p + g * (P - p)) * h * e if p else decode  # the prefill's (prefix, rows) pair stays on the gpu
    # with K > 2 the next GPU batch's parked hidden, loaded a slot ahead (`runtime.schedule`) while this one
    # computes: its parts off the gpu come back into device memory the executor does not reserve, at the
    # prefill, when the decode's hiddens are not there (the larger of the two)
    ahead = max(0.0, g * P * h * e - decode) if K > 2 and not p and P > 1 and device_type != "cpu" else 0.0
    if device_type == "cpu":                                    # scores [c, nh, P - p, P]; the prefix's [1, nh, p, p]
        kept += max(chunk_rows(g, P - p) * nh * (P - p) * P, nh * p * p) * e
    return placed, kept, ahead


def untracked_gpu_bytes(config: ModelConfig, policy: Policy, prompt_len: int, bytes_per_element: int,
                        device_type: str, *, shared_prefix_len: int = 0) -> int:
    """Device memory the executor uses but does not reserve: the hidden states of the other GPU batches
    between layers (with a prefix computed once, its prefill's (prefix, rows) pairs, which are never parked;
    the prefill's by the gpu share of hidden states, a decode step's, never parked, by the rest: affine in
    act_gpu, exact at 0 and 1, above the larger of the two between), on an accelerator with K > 2 the next GPU
    batch's parked hidden loaded a slot ahead (by the share off the gpu), and on a CPU device the attention scores
    of the math SDPA path (one prefill row chunk)."""
    placed, kept, ahead = _untracked_terms(config, policy, prompt_len, bytes_per_element, device_type,
                                           shared_prefix_len)
    return int(placed * policy.act_gpu + kept + ahead * (1.0 - policy.act_gpu))


def peak_memory(config: ModelConfig, layout: ModelLayout, policy: Policy, prompt_len: int, gen_len: int,
                bytes_per_element: int, device_type: str, *, shared_prefix_len: int = 0,
                num_prompts: int | None = 1) -> dict[str, int]:
    """`executor_memory` plus the untracked device memory: what the budgets must hold."""
    mem = executor_memory(config, layout, policy, prompt_len, gen_len, bytes_per_element, device_type,
                          shared_prefix_len=shared_prefix_len, num_prompts=num_prompts)
    mem["gpu"] += untracked_gpu_bytes(config, policy, prompt_len, bytes_per_element, device_type,
                                      shared_prefix_len=shared_prefix_len)
    return mem


def memory_terms(config: ModelConfig, layout: ModelLayout, policy: Policy, prompt_len: int, gen_len: int,
                 bytes_per_element: int, device_type: str, *, shared_prefix_len: int = 0,
                 num_prompts: int | None = 1) -> dict[str, np.ndarray]:
    """`peak_memory` as affine expressions in the placement fractions (module docstring): the executor's
    memory with every class on the gpu, plus each class's shares of the cpu and of disk times what moving it
    wholly there changes, plus the untracked device memory's own affine form."""
    def at(**fractions: float) -> dict[str, int]:
        return executor_memory(config, layout, replace(base, **fractions), prompt_len, gen_len, bytes_per_element,
                               device_type, shared_prefix_len=shared_prefix_len, num_prompts=num_prompts)

    base = replace(policy, w_gpu=1.0, w_cpu=0.0, w_gpu_extra=0, cache_gpu=1.0, cache_cpu=0.0, act_gpu=1.0,
                   act_cpu=0.0)
    held = layout.view(bytes_per_element, policy.compress_weights).held_fraction(device_type)
    scale = 1.0 / (1.0 - held) if held < 1.0 else 0.0      # the weights' vertex puts 1 - held off the gpu
    resident = at()
    terms = {tier: const(resident[tier]) for tier in TIERS}
    for cls, weight in (("w", scale), ("cache", 1.0), ("act", 1.0)):
        for tier, fractions in (("cpu", (0.0, 1.0)), ("disk", (0.0, 0.0))):
            moved = at(**{f"{cls}_gpu": fractions[0], f"{cls}_cpu": fractions[1]})
            for t in TIERS:
                terms[t] = terms[t] + share(cls, tier) * (weight * (moved[t] - resident[t]))
    placed, kept, ahead = _untracked_terms(config, policy, prompt_len, bytes_per_element, device_type,
                                           shared_prefix_len)
    terms["gpu"] = terms["gpu"] + share("act", "gpu") * placed + const(kept) + share("act", "off") * ahead
    return terms


def weight_fraction_on(layout: ModelLayout, w_gpu: float, w_cpu: float, device_type: str = "cpu",
                       extra: int = 0) -> tuple[float, float]:
    """(gpu, cpu) fractions of all weight bytes the executor places for these policy fractions and `extra`
    (`Policy.w_gpu_extra`) on a `device_type` device (on CUDA the held kinds count on the gpu)."""
    on = layout.bytes_on(layout.placed(w_gpu, w_cpu, device_type, extra))
    total = layout.total_bytes or 1
    return on["gpu"] / total, on["cpu"] / total


def split_fraction_on(n: int, gpu: float, cpu: float) -> tuple[float, float]:
    """(gpu, cpu) fractions of n items (kv heads, hidden features) `split_ranges` puts on each tier."""
    on = {t: 0 for t in TIERS}
    for tier, a, b in split_ranges(n, gpu, cpu):
        on[tier] += b - a
    return on["gpu"] / n, on["cpu"] / n


def realized_placement(config: ModelConfig, layout: ModelLayout, policy: Policy,
                       device_type: str = "cpu") -> np.ndarray:
    """The fractions of bytes [6] (VARS order) the executor really puts on gpu/cpu for `policy` on a
    `device_type` device."""
    wg, wc = weight_fraction_on(layout, policy.w_gpu, policy.w_cpu, device_type, policy.w_gpu_extra)
    cg, ccpu = split_fraction_on(config.num_key_value_heads, policy.cache_gpu, policy.cache_cpu)
    ag, ac = split_fraction_on(config.hidden_size, policy.act_gpu, policy.act_cpu)
    return np.array([wg, wc, cg, ccpu, ag, ac])


def weight_settings(layout: ModelLayout) -> list[float]:
    """Policy weight fractions giving every distinct placement once, ascending: 0, just past each tensor
    midpoint, 1 (a placement that 0 or 1 already gives is represented by 0 or 1)."""
    values = sorted({0.0, 1.0, *(m + _STEP for m in layout.midpoints if m + _STEP < 1.0)})
    by_realized: dict[float, float] = {}
    for v in values:
        r = weight_fraction_on(layout, v, 0.0)[0]
        if r not in by_realized or v in (0.0, 1.0):
            by_realized[r] = v
    return sorted(by_realized.values())

