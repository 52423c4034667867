"""Policy search: enumerate batch shapes and flags, solve an LP over placement for each (FlexGen, sec. 4.3).

For each (gpu_batch_size, num_gpu_batches, cpu_attention) and slot regime (the whole cache and every hidden
state on the gpu, or free: the executor's per-slot host time steps up when any share moves off the gpu,
see `cost_model.SlotCosts`) the placement fractions x [6] and two layer times t_pre, t_gen are found by
`scipy.optimize.linprog(method="highs")`:
    minimize   L * t_pre + L * (n - 1) * t_gen                   (block time; bls * n tokens per block)
    subject to channel_c(x) <= t_pre for every prefill channel   (sum of channels <= t_pre without overlap)
               channel_c(x) <= t_gen for every decode channel
               memory_tier(x) <= relax_tier * budget_tier         (tier in gpu, cpu, disk)
               w_gpu + w_cpu <= 1, cache_gpu + cache_cpu <= 1, act_gpu + act_cpu <= 1, 0 <= x <= 1,
               w_gpu >= the share of the kinds held whole on the device (`CostTerms.w_gpu_min`)
The LP's fractions are then rounded to placements the executor realizes exactly (weights move as whole
tensors, the cache as whole kv heads: `memory.weight_settings`, `split_ranges`); the fastest rounding whose
exact memory (`memory.peak_memory`, the executor's own accounting) fits the relaxed budgets is kept; when
none fits, the LP is solved again with the weights fixed at each weight setting the rounding tried (whole
tensors can land far from the LP's share), and then, if still none fits, with the overshoot (doubled at each
retry) taken off the budgets. On CUDA the embedding and the head are held on the device (`w_gpu >= their
share`: `weight_slots.held_whole`).
A MoE model attending on the host is paged finely (`cost_model.weight_pages`) or, where the model prices it
faster at the realized placement, one page per GPU batch (`_coarser_pages`: pages cost the executor host time).
The shape with the highest predicted throughput wins (ties: the smaller block, then fewer GPU batches);
`search_top` returns the best few for trials. Times are scaled to ms and bytes to GiB inside the LP for conditioning.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from engine.policy import model_stats as ms
from engine.policy.affine import NUM_VARS, VARS
from engine.policy.buffers import runs_ahead
from engine.policy.cost_model import (
    TIERS, CostEstimate, CostTerms, Workload, cost_terms, decode_slack, estimate, model_view, weight_pages,
)
from engine.policy.estimate import Budgets, NoFeasiblePolicy, PolicyEstimate, workload_dict
from engine.policy.hardware import GIB, HardwareProfile
from engine.policy.layout import ModelConfig, ModelLayout
from engine.policy.memory import peak_memory, weight_fraction_on, weight_settings
from engine.policy.policy import Policy
from engine.util.sizes import format_size

GPU_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
NUM_GPU_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
_TIME_SCALE = 1e3      # seconds -> ms
_SNAP = 1e-4           # fractions this close to 0 or 1 are snapped
_TIE_BREAK = 1e-6      # ms per layer-step of objective per unit of fraction kept on a faster tier


def candidate_shapes(num_prompts: int | None, gpu_batch_sizes: Sequence[int] = GPU_BATCH_SIZES,
                     num_gpu_batches: Sequence[int] = NUM_GPU_BATCHES) -> list[tuple[int, int]]:
    """(gpu_batch_size, num_gpu_batches) pairs; with `num_prompts`, only blocks of at most num_prompts
    sequences, plus for each count of GPU batches the largest batch size that stays within them."""
    shapes = {(g, k) for g in gpu_batch_sizes for k in num_gpu_batches}
    if num_prompts is not None:
        shapes = {(g, k) for g, k in shapes if g * k <= num_prompts}
        shapes |= {(num_prompts // k, k) for k in num_gpu_batches if k <= num_prompts}
    return sorted(shapes)


def _solve(terms: CostTerms, limits: dict[str, float], resident: bool,
           weights: tuple[float, float] | None = None) -> np.ndarray | None:
    """The LP's optimal placement x [6] in one slot regime, or None when infeasible: `resident` keeps the
    whole cache and every hidden state on the gpu and charges the resident slot time; otherwise the
    placement is free and every slot extra is charged (`SlotCosts.regime_seconds`). `weights`: the
    (gpu, cpu) weight shares fixed at these values."""
    n_vars = NUM_VARS + 2                                   # x, t_pre, t_gen
    rows, rhs = [], []

    def add_time(channels: dict[str, np.ndarray], t_index: int, overlap: bool) -> None:
        exprs = list(channels.values()) if overlap else [sum(channels.values())]
        for expr in exprs:
            row = np.zeros(n_vars)
            row[:NUM_VARS] = expr[:NUM_VARS] * _TIME_SCALE
            row[t_index] = -1.0
            rows.append(row)
            rhs.append(-expr[NUM_VARS] * _TIME_SCALE)

    add_time(terms.channels("prefill", terms.prefill_slots.regime_seconds(resident)), NUM_VARS, terms.overlap)
    add_time(terms.channels("decode", terms.decode_slots.regime_seconds(resident)), NUM_VARS + 1, terms.overlap)
    for tier in TIERS:
        row = np.zeros(n_vars)
        row[:NUM_VARS] = terms.memory[tier][:NUM_VARS] / GIB
        rows.append(row)
        rhs.append((limits[tier] - terms.memory[tier][NUM_VARS]) / GIB)
    for i in range(0, NUM_VARS, 2):                        # gpu + cpu share of each class <= 1
        row = np.zeros(n_vars)
        row[i] = row[i + 1] = 1.0
        rows.append(row)
        rhs.append(1.0)
    cost = np.zeros(n_vars)
    cost[NUM_VARS] = terms.num_layers * terms.prefill_in_series
    cost[NUM_VARS + 1] = terms.num_layers * (terms.gen_len - 1)
    # tie-break among equally fast placements: prefer gpu over cpu over disk (no effect on the optimum)
    cost[:NUM_VARS] = -_TIE_BREAK * terms.num_layers * terms.gen_len * np.tile([2.0, 1.0], NUM_VARS // 2)
    bounds = [(0.0, 1.0)] * NUM_VARS + [(0.0, None)] * 2
    bounds[VARS.index("w_gpu")] = (min(1.0, terms.w_gpu_min), 1.0)   # the kinds held whole (embedding, head)
    if weights is not None:
        bounds[VARS.index("w_gpu")] = (weights[0], weights[0])
        bounds[VARS.index("w_cpu")] = (weights[1], weights[1])
    if resident:
        for name in ("cache_gpu", "act_gpu"):
            bounds[VARS.index(name)] = (1.0, 1.0)
    from scipy.optimize import linprog   # imported here: a run whose plan is cached never loads scipy (~1 s)

    result = linprog(cost, A_ub=np.array(rows), b_ub=np.array(rhs), bounds=bounds, method="highs")
    return result.x[:NUM_VARS] if result.status == 0 else None


def _snap(x: np.ndarray) -> np.ndarray:
    """Clip to [0, 1], snap near-0/near-1 values and keep gpu + cpu <= 1 per class."""
    x = np.clip(x, 0.0, 1.0)
    x = np.where(x < _SNAP, 0.0, np.where(x > 1 - _SNAP, 1.0, x))
    for i in range(0, NUM_VARS, 2):
        if x[i] + x[i + 1] > 1 - _SNAP:                    # no disk share: make it exactly zero
            x[i + 1] = 1.0 - x[i]
    return np.round(x, 6)


def _floor_ceil(values: Sequence[float], realized: Sequence[float], target: float) -> list[float]:
    """The settings whose realized fractions are the nearest at or below and at or above `target`."""
    below = [v for v, r in zip(values, realized) if r <= target + 1e-9]
    above = [v for v, r in zip(values, realized) if r >= target - 1e-9]
    return sorted({below[-1] if below else values[0], above[0] if above else values[-1]})


def _grid(n: int, target: float) -> list[float]:
    """m / n for the m just below and just above target * n (kv heads: `split_ranges` rounds to these)."""
    return sorted({min(n, max(0, math.floor(target * n + 1e-9))) / n, min(n, max(0, math.ceil(target * n - 1e-9))) / n})


def _realizations(config: ModelConfig, layout: ModelLayout, shape: Policy, x: np.ndarray,
                  device_type: str) -> list[Policy]:
    """Policies near the LP's fractions x [6] that the executor places exactly as stated: weights split at
    tensor boundaries, the cache at kv-head boundaries, hidden states at feature boundaries; and each of
    these with every hidden state on the gpu (the free regime's LP pays the parked-hidden-state extra
    whether or not any leave the gpu, so it parks them where memory is free; the exact cost does not)."""
    settings = weight_settings(layout)
    realized = [weight_fraction_on(layout, v, 0.0, device_type)[0] for v in settings]
    nkv, h = config.num_key_value_heads, config.hidden_size
    ag = round(x[4] * h) / h
    ac = max(0.0, min(1.0, round((x[4] + x[5]) * h) / h) - ag)
    acts = [(ag, ac)] + ([(1.0, 0.0)] if ag < 1.0 else [])
    out = []
    for wg in _floor_ceil(settings, realized, x[0]):
        for wu in _floor_ceil(settings, realized, x[0] + x[1]):
            if wu < wg:
                continue
            for cg in _grid(nkv, x[2]):
                for cu in _grid(nkv, x[2] + x[3]):
                    if cu < cg:
                        continue
                    out.extend(replace(shape, w_gpu=wg, w_cpu=round(wu - wg, 9), cache_gpu=cg,
                                       cache_cpu=round(cu - cg, 9), act_gpu=a_gpu, act_cpu=a_cpu)
                               for a_gpu, a_cpu in acts)
    return out


@dataclass(frozen=True)
class _Candidate:
    tokens_per_s: float
    policy: Policy
    estimate: CostEstimate


def _best_realization(config: ModelConfig, layout: ModelLayout, shape: Policy, terms: CostTerms,
                      workload: Workload, profile: HardwareProfile, bytes_per_element: int,
                      limits: dict[str, float]) -> tuple[_Candidate | None, bool]:
    """(the faster of the two slot regimes' best realizations or None, whether the free regime's LP is
    feasible at all: when it is not, no larger GPU batch of this shape fits either)."""
    args = (config, layout, shape, terms, workload, profile, bytes_per_element, limits)
    resident, _ = _regime_realization(*args, resident=True)
    free, feasible = _regime_realization(*args, resident=False)
    found = [c for c in (resident, free) if c is not None]
    return max(found, key=lambda c: c.tokens_per_s, default=None), feasible


def _fitting_best(config: ModelConfig, layout: ModelLayout, policies: list[Policy], terms: CostTerms,
                  workload: Workload, profile: HardwareProfile, bytes_per_element: int,
                  limits: dict[str, float]) -> tuple[_Candidate | None, dict[str, float]]:
    """(the fastest of `policies` whose exact memory fits `limits`, or None; the largest overshoot per tier
    of those that do not fit)."""
    best, overshoot = None, {t: 0.0 for t in TIERS}
    for policy in policies:
        est = estimate(config, policy, workload, profile, bytes_per_element, layout=layout, terms=terms)
        over = {t: est.peak_memory_bytes[t] - limits[t] for t in TIERS}
        if all(v <= 0 for v in over.values()):
            if best is None or est.tokens_per_s > best.tokens_per_s * (1 + 1e-9):
                best = _Candidate(est.tokens_per_s, policy, est)
        else:
            overshoot = {t: max(overshoot[t], over[t]) for t in TIERS}
    return best, overshoot


def _regime_realization(config: ModelConfig, layout: ModelLayout, shape: Policy, terms: CostTerms,
                        workload: Workload, profile: HardwareProfile, bytes_per_element: int,
                        limits: dict[str, float], resident: bool,
                        retries: int = 4) -> tuple[_Candidate | None, bool]:
    """Solve the regime's LP, round its placement to what the executor realizes, keep the fastest rounding
    (costed at its exact placement) whose exact memory fits `limits`. When none fits, branch on the weight
    rounding first: weights move as whole tensors, so the LP's weight share rounds to a setting whose bytes
    can be far from it; for each weight setting the rounding tried, the LP is solved again with the weights
    fixed there, and the cache and hidden states placed around them (the weights on the cpu with part of the
    cache on the gpu, where the LP's weights past a tensor boundary fit neither way). When that finds none
    either, tighten the LP's limits by the overshoot (doubled at every retry: a small step can leave the
    rounding where it was) and solve again. The candidate found then fills the device memory left with cache
    (`_fill_cache`), then with whole weight tensors (`_fill_weights`). Returns (candidate or None, whether the
    first LP, at `limits`, was feasible)."""
    args = (terms, workload, profile, bytes_per_element, limits)
    lp_limits = dict(limits)
    for attempt in range(retries + 1):
        x = _solve(terms, lp_limits, resident)
        if x is None:
            return None, attempt > 0
        rounded = _realizations(config, layout, shape, _snap(x), profile.device_type)
        best, overshoot = _fitting_best(config, layout, rounded, *args)
        if best is None and attempt == 0:
            best = _weight_branches(config, layout, shape, rounded, resident, *args)
        if best is not None:
            return _fill_weights(config, layout, _fill_cache(config, layout, best, *args), *args), True
        for tier in TIERS:
            if overshoot[tier] > 0:
                lp_limits[tier] -= overshoot[tier] * 2 ** attempt
    return None, True


def _fill_cache(config: ModelConfig, layout: ModelLayout, best: _Candidate, terms: CostTerms, workload: Workload,
                profile: HardwareProfile, bytes_per_element: int, limits: dict[str, float]) -> _Candidate:
    """`best` with as many more kv heads of its host cache on the gpu as still fit `limits`, when that is
    faster. The LP prices a byte of weights and a byte of cache on the link alike, so it can give the device
    memory to weights that then round down to a tensor boundary, leaving that memory empty (Mixtral-8x7B over
    4,096 rows at 16 GiB: 4096x1 with every weight streamed and 10 of 16 GiB used)."""
    nkv = config.num_key_value_heads
    on_gpu = round(best.policy.cache_gpu * nkv)
    on_cpu = round((best.policy.cache_gpu + best.policy.cache_cpu) * nkv) - on_gpu   # heads, as split_ranges
    for moved in range(1, on_cpu + 1):
        more = replace(best.policy, cache_gpu=(on_gpu + moved) / nkv, cache_cpu=(on_cpu - moved) / nkv)
        est = estimate(config, more, workload, profile, bytes_per_element, layout=layout, terms=terms)
        if est.peak_memory_bytes["gpu"] > limits["gpu"]:
            break
        if est.tokens_per_s > best.tokens_per_s * (1 + 1e-9):
            best = _Candidate(est.tokens_per_s, more, est)
    return best


def _fill_weights(config: ModelConfig, layout: ModelLayout, best: _Candidate, terms: CostTerms,
                  workload: Workload, profile: HardwareProfile, bytes_per_element: int,
                  limits: dict[str, float]) -> _Candidate:
    """`best` with the most `Policy.w_gpu_extra` tensors that still fit `limits`, when that is faster. A weight
    share moves a whole tensor in every layer, so the device memory under the next share stays empty
    (Mixtral-8x7B over 2,048 rows at 16 GiB: 1.1 GiB under the limit with a third of its experts on the gpu,
    where the next third is 7.9 GiB); one tensor in some of the layers uses it. Each further tensor adds its
    stored bytes to the device (`ModelLayout.extra_sizes`), so the count is read off the memory left and then
    checked against the exact memory, one fewer at a time until it fits."""
    p = best.policy
    left = limits["gpu"] - best.estimate.peak_memory_bytes["gpu"]
    count, used = p.w_gpu_extra, 0
    for size in layout.extra_sizes(p.w_gpu, p.w_cpu, profile.device_type)[p.w_gpu_extra:]:
        if used + size > left:
            break
        count, used = count + 1, used + size
    for n in range(count, p.w_gpu_extra, -1):
        policy = replace(p, w_gpu_extra=n)
        est = estimate(config, policy, workload, profile, bytes_per_element, layout=layout, terms=terms)
        if all(est.peak_memory_bytes[t] <= limits[t] for t in TIERS):
            faster = est.tokens_per_s > best.tokens_per_s * (1 + 1e-9)
            return _Candidate(est.tokens_per_s, policy, est) if faster else best
    return best


def _weight_branches(config: ModelConfig, layout: ModelLayout, shape: Policy, rounded: list[Policy],
                     resident: bool, terms: CostTerms, workload: Workload, profile: HardwareProfile,
                     bytes_per_element: int, limits: dict[str, float]) -> _Candidate | None:
    """The fastest fitting realization of the LP re-solved with the weights fixed at each distinct weight
    setting of `rounded` (its realized byte shares), or None."""
    best = None
    for wg, wc in sorted({(p.w_gpu, p.w_cpu) for p in rounded}):
        on_gpu, on_cpu = weight_fraction_on(layout, wg, wc, profile.device_type)
        x = _solve(terms, limits, resident, weights=(on_gpu, on_cpu))
        if x is None:
            continue
        kept = [p for p in _realizations(config, layout, shape, _snap(x), profile.device_type)
                if (p.w_gpu, p.w_cpu) == (wg, wc)]
        found, _ = _fitting_best(config, layout, kept, terms, workload, profile, bytes_per_element, limits)
        if found is not None and (best is None or found.tokens_per_s > best.tokens_per_s * (1 + 1e-9)):
            best = found
    return best


def search_top(
    config: ModelConfig,
    workload: Workload,
    budgets: Budgets,
    profile: HardwareProfile,
    *,
    top: int = 1,
    bytes_per_element: int = 2,
    compress_weights: bool | None = False,
    compress_cache: bool | None = False,
    cpu_attention: bool | None = None,
    overlap: bool = True,
    gpu_batch_sizes: Sequence[int] = GPU_BATCH_SIZES,
    num_gpu_batches: Sequence[int] = NUM_GPU_BATCHES,
    relax_gpu: float = 0.95,
    relax_cpu: float = 0.9,
    relax_disk: float = 0.95,
    model_name: str = "model",
    layout: ModelLayout | None = None,
) -> list[PolicyEstimate]:
    """The `top` distinct policies with the highest predicted throughput that fit `budgets` (bytes), best
    first: at most one per (batch shape, flags); the candidates are taken over the flag kinds
    (cpu_attention, compress_weights, compress_cache), best kind first, two per kind (`_diverse`), so trials
    compare kinds and shapes. When the search decides `cpu_attention`, a cpu-attention placement with the
    whole cache on the gpu is dropped (the executor runs it exactly as the placement without the flag).

    Each policy's placement is what the executor realizes (whole tensors, whole kv heads) and its peak
    memory per tier, as the executor counts it, fits `relax_* x budget`. `relax_*` scale each budget
    (head-room for allocator rounding and fragmentation); `cpu_attention`, `compress_weights` and
    `compress_cache` None try both settings (compression changes the outputs slightly: callers that
    need exact outputs pass False). `layout`: the model's (`engine.runtime.layout.model_layout`). Raises
    NoFeasiblePolicy, saying what does not fit, when no shape fits.
    """
    if top < 1:
        raise ValueError(f"search_top: top must be >= 1, got {top}")
    relax = {"gpu": relax_gpu, "cpu": relax_cpu, "disk": relax_disk}
    limits = {t: relax[t] * budgets.of(t) for t in TIERS}
    both = (False, True)
    flag_sets = [(att, cw, cc) for att in (both if cpu_attention is None else (cpu_attention,))
                 for cw in (both if compress_weights is None else (compress_weights,))
                 for cc in (both if compress_cache is None else (compress_cache,))]
    layouts = {cw: model_view(layout, bytes_per_element, cw, "search") for _, cw, _ in flag_sets}
    found: list[_Candidate] = []
    infeasible_from: dict[tuple, int] = {}                  # (k, flags) -> smallest g whose LP is infeasible
    for g, k in candidate_shapes(workload.num_prompts, gpu_batch_sizes, num_gpu_batches):
        for flags in flag_sets:
            if g >= infeasible_from.get((k, flags), g + 1):
                continue                                    # memory only grows with g: also infeasible
            cpu_att, cw, cc = flags
            shape = Policy(gpu_batch_size=g, num_gpu_batches=k, overlap=overlap, cpu_attention=cpu_att,
                           compress_weights=cw, compress_cache=cc,
                           weight_pages=weight_pages(config, layouts[cw], k, cpu_att))
            best, feasible = None, False
            ahead = replace(shape, prefill_ahead=True)
            for variant in (shape, ahead) if runs_ahead(ahead, workload.gen_len, workload.num_prompts) else (shape,):
                terms = cost_terms(config, variant, workload, profile, bytes_per_element, layouts[cw])
                found_v, feasible_v = _best_realization(config, layouts[cw], variant, terms, workload, profile,
                                                        bytes_per_element, limits)
                feasible = feasible or feasible_v
                if found_v is not None and (best is None or found_v.tokens_per_s > best.tokens_per_s):
                    best = found_v            # the ahead prefill where it is predicted faster and fits
            if not feasible:
                infeasible_from[(k, flags)] = g
            if best is None:
                continue
            best = _coarser_pages(config, layouts[cw], best, workload, profile, bytes_per_element, limits)
            if cpu_attention is None and cpu_att and best.policy.cache_gpu >= 1.0:
                continue                # no cache off the gpu, no host attention: the same run as without
            found.append(best)
    if not found:
        raise NoFeasiblePolicy(_no_fit_message(config, layouts[compress_weights is not False], workload, budgets,
                                               relax, bytes_per_element, compress_cache is not False, model_name,
                                               profile.device_type))
    found.sort(key=_rank)
    chosen = _diverse(found, top)
    context = {
        "model": model_name, "device_name": profile.device_name, "profile_source": profile.source,
        "workload": workload_dict(workload),
        "budgets_bytes": {t: budgets.of(t) for t in TIERS},
    }
    return [PolicyEstimate(c.policy, c.tokens_per_s, c.estimate.prefill_s, c.estimate.decode_s,
                           c.estimate.peak_memory_bytes,
                           {"prefill": c.estimate.prefill_bottleneck, "decode": c.estimate.decode_bottleneck},
                           {**context, **_held_context(layouts[c.policy.compress_weights], profile.device_type),
                            **_extra_context(layouts[c.policy.compress_weights], c.policy, profile.device_type),
                            **_slack_context(config, c.policy, workload, profile, bytes_per_element,
                                             layouts[c.policy.compress_weights])})
            for c in chosen]


def _coarser_pages(config: ModelConfig, layout: ModelLayout, found: _Candidate, workload: Workload,
                   profile: HardwareProfile, bytes_per_element: int, limits: dict[str, float]) -> _Candidate:
    """`found`, or the same placement with one weight page per GPU batch where the model prices that faster
    and it fits: each page costs the executor host time (`HardwareProfile.weight_page_ms`), a finer page lets
    host attention's outputs through sooner. Re-costed at the realized placement, no LP."""
    policy = found.policy
    if policy.weight_pages <= policy.num_gpu_batches:
        return found
    one_each = replace(policy, weight_pages=policy.num_gpu_batches)
    terms = cost_terms(config, one_each, workload, profile, bytes_per_element, layout)
    coarse, _ = _fitting_best(config, layout, [one_each], terms, workload, profile, bytes_per_element, limits)
    return coarse if coarse is not None and coarse.tokens_per_s > found.tokens_per_s * (1 + 1e-9) else found


def _slack_context(config: ModelConfig, policy: Policy, workload: Workload, profile: HardwareProfile,
                   bytes_per_element: int, layout: ModelLayout) -> dict:
    """`decode_slack` for a PolicyEstimate's context where the policy runs prefills ahead (`cost_model.
    decode_slack`: what a trial of single blocks charges the carried prefill with, `calibrate.trial`)."""
    if not runs_ahead(policy, workload.gen_len, workload.num_prompts):
        return {}
    return {"decode_slack": decode_slack(config, policy, workload, profile, bytes_per_element, layout)}


def _held_context(layout: ModelLayout, device_type: str) -> dict:
    """`held_weights` for a PolicyEstimate's context: the kinds on the device whatever w_gpu says and their
    share of the weight bytes (none on a CPU device)."""
    held = layout.held(device_type)
    if not held:
        return {}
    return {"held_weights": {"kinds": sorted(held), "share": layout.held_fraction(device_type)}}


def _extra_context(layout: ModelLayout, policy: Policy, device_type: str) -> dict:
    """`extra_weights_share` for a PolicyEstimate's context: the share of the weight bytes its `w_gpu_extra`
    tensors add on the gpu (nothing without them)."""
    if not policy.w_gpu_extra:
        return {}
    with_extra = weight_fraction_on(layout, policy.w_gpu, policy.w_cpu, device_type, policy.w_gpu_extra)[0]
    return {"extra_weights_share": with_extra - weight_fraction_on(layout, policy.w_gpu, policy.w_cpu, device_type)[0]}


def _rank(c: _Candidate) -> tuple[float, int, int]:
    """Best first: the highest predicted throughput; at a tie the smaller block, then fewer GPU batches (larger
    GEMMs and fewer slots for the same bytes moved: a transfer-bound Mixtral-8x7B at 1,024 rows predicts 512x2
    and 1024x1 the same, and 1024x1 is the shape measured on an H200)."""
    return -c.tokens_per_s, c.policy.block_size, c.policy.num_gpu_batches


def _kind(c: _Candidate) -> tuple[bool, bool, bool]:
    p = c.policy
    return p.cpu_attention, p.compress_weights, p.compress_cache


def _diverse(ranked: list[_Candidate], top: int) -> list[_Candidate]:
    """The best `top` of `ranked` (best first) for trials: flag kinds (`_kind`) in the order of each kind's
    best, each kind contributing its best and its best shape with one GPU batch (a hedge: on an H200 the
    model's many-batch choices measure 2-5x below their prediction, from per-slot costs it undercounts, and
    the best measured policies have one GPU batch; `benchmarks/policy/policy_validation.py`); once
    every kind has given those two, the rest round-robin over the kinds. The first is always the best."""
    kinds: dict[tuple[bool, bool, bool], list[_Candidate]] = {}
    for c in ranked:
        kinds.setdefault(_kind(c), []).append(c)
    queues = [_one_batch_second(q) for q in kinds.values()]  # ranked is best first, so is this order
    chosen = [c for q in queues for c in q[:2]]
    depth = 2
    while len(chosen) < top and any(depth < len(q) for q in queues):
        chosen.extend(q[depth] for q in queues if depth < len(q))
        depth += 1
    return sorted(chosen[:top], key=_rank)


def _one_batch_second(queue: list[_Candidate]) -> list[_Candidate]:
    """`queue` (best first) with its best one-GPU-batch candidate moved to second place."""
    one = next((c for c in queue[1:] if c.policy.num_gpu_batches == 1), None)
    if one is None or queue[0].policy.num_gpu_batches == 1:
        return queue
    return [queue[0], one] + [c for c in queue[1:] if c is not one]


def search(config: ModelConfig, workload: Workload, budgets: Budgets, profile: HardwareProfile,
           **kwargs) -> PolicyEstimate:
    """The policy with the highest predicted throughput that fits `budgets` (bytes) under the cost model.

    Keyword arguments are `search_top`'s (except `top`; `layout`, the model's, is needed). Raises
    NoFeasiblePolicy, saying what does not fit, when no shape fits.
    """
    return search_top(config, workload, budgets, profile, top=1, **kwargs)[0]


def _no_fit_message(config: ModelConfig, layout: ModelLayout, workload: Workload, budgets: Budgets,
                    relax: dict[str, float], bytes_per_element: int, compress_cache: bool, model_name: str,
                    device_type: str) -> str:
    """Why nothing fits: the smallest block's needs (all tiers together, the gpu's working set, and on a GPU
    the host memory of one row with every weight streamed) against the relaxed budgets; `layout` the model's
    with the weight compression tried (compressed when the search tried it)."""
    B, compress_weights = bytes_per_element, layout.compress_weights
    weights = (ms.layer_weight_bytes(config, B, compress_weights) * config.num_hidden_layers
               + ms.edge_weight_bytes(config, B))
    s = workload.memory_prompt_len + workload.gen_len
    cache = config.num_hidden_layers * s * ms.kv_bytes_per_token(config, B, compress_cache)
    usable = {t: relax[t] * budgets.of(t) for t in TIERS}
    stage = ms.largest_stage_bytes(config, B, compress_weights)
    parts = [
        f"no policy fits {model_name} ({format_size(weights)} of weights"
        + (" at 4-bit" if compress_weights or config.quantization_config else f" at {8 * B}-bit")
        + f", {format_size(cache)} of KV cache per "
        f"sequence of {s} tokens) in the budgets: "
        + ", ".join(f"{t} {format_size(budgets.of(t))} (usable {format_size(usable[t])})" for t in TIERS)
    ]
    if 2 * stage > usable["gpu"]:
        parts.append(f"the GPU budget cannot hold two in-flight copies of the largest layer "
                     f"({format_size(2 * stage)})")
    if weights + cache > sum(usable.values()):
        parts.append(f"weights + one sequence's cache need {format_size(weights + cache)} but all tiers "
                     f"together offer {format_size(sum(usable.values()))}; add CPU memory or a disk budget"
                     + ("" if compress_weights or config.quantization_config else ", or compress weights"))
    elif budgets.disk_bytes == 0 and weights > usable["gpu"] + usable["cpu"]:
        parts.append("the weights do not fit in GPU + CPU memory and the disk budget is 0")
    elif device_type == "cuda" and budgets.disk_bytes == 0:
        streamed = Policy(gpu_batch_size=1, w_gpu=0.0, w_cpu=1.0, compress_weights=compress_weights,
                          compress_cache=compress_cache)
        host = peak_memory(config, layout, streamed,
                           workload.memory_prompt_len, workload.gen_len, B, device_type,
                           shared_prefix_len=workload.shared_prefix_len)["cpu"]
        if host > usable["cpu"]:
            parts.append(f"with every weight streamed from the host, one row needs {format_size(host)} of CPU "
                         f"memory (weights and host buffers), and no share of the weights the GPU budget holds "
                         f"(whole tensors, the same share of every layer) brings it under; raise cpu_memory or "
                         f"give a disk budget")
    return "; ".join(parts)
