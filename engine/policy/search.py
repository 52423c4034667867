"""Policy search: enumerate batch shapes and flags, solve an LP over placement for each (FlexGen, sec. 4.3).

For each (gpu_batch_size, num_gpu_batches, cpu_attention) the placement fractions x [6] and two layer
times t_pre, t_gen are found by `scipy.optimize.linprog(method="highs")`:
    minimize   L * t_pre + L * (n - 1) * t_gen                   (block time; bls * n tokens per block)
    subject to channel_c(x) <= t_pre for every prefill channel   (sum of channels <= t_pre without overlap)
               channel_c(x) <= t_gen for every decode channel
               memory_tier(x) <= relax_tier * budget_tier         (tier in gpu, cpu, disk)
               w_gpu + w_cpu <= 1, cache_gpu + cache_cpu <= 1, act_gpu + act_cpu <= 1, 0 <= x <= 1
The shape with the highest predicted throughput wins (ties: the smaller block). Times are scaled to ms and
bytes to GiB inside the LP for conditioning.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np
from scipy.optimize import linprog

from engine.models.config import ModelConfig
from engine.policy import model_stats as ms
from engine.policy.affine import NUM_VARS, VARS
from engine.policy.cost_model import TIERS, CostTerms, Workload, cost_terms, estimate_terms
from engine.policy.estimate import Budgets, NoFeasiblePolicy, PolicyEstimate, workload_dict
from engine.policy.hardware import GIB, HardwareProfile
from engine.policy.policy import Policy
from engine.sizes import format_size

GPU_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
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


def _solve(terms: CostTerms, budgets: Budgets, relax: dict[str, float]) -> np.ndarray | None:
    """The LP's optimal placement x [6], or None when infeasible."""
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

    add_time(terms.prefill, NUM_VARS, terms.overlap)
    add_time(terms.decode, NUM_VARS + 1, terms.overlap)
    for tier in TIERS:
        row = np.zeros(n_vars)
        row[:NUM_VARS] = terms.memory[tier][:NUM_VARS] / GIB
        rows.append(row)
        rhs.append((relax[tier] * budgets.of(tier) - terms.memory[tier][NUM_VARS]) / GIB)
    for i in range(0, NUM_VARS, 2):                        # gpu + cpu share of each class <= 1
        row = np.zeros(n_vars)
        row[i] = row[i + 1] = 1.0
        rows.append(row)
        rhs.append(1.0)
    cost = np.zeros(n_vars)
    cost[NUM_VARS] = terms.num_layers
    cost[NUM_VARS + 1] = terms.num_layers * (terms.gen_len - 1)
    # tie-break among equally fast placements: prefer gpu over cpu over disk (no effect on the optimum)
    cost[:NUM_VARS] = -_TIE_BREAK * terms.num_layers * terms.gen_len * np.tile([2.0, 1.0], NUM_VARS // 2)
    bounds = [(0.0, 1.0)] * NUM_VARS + [(0.0, None)] * 2
    result = linprog(cost, A_ub=np.array(rows), b_ub=np.array(rhs), bounds=bounds, method="highs")
    return result.x[:NUM_VARS] if result.status == 0 else None


def _better(tokens_per_s: float, block: int, best_tokens_per_s: float, best_block: int) -> bool:
    """Higher throughput wins; within a relative 1e-6 the smaller block wins."""
    if tokens_per_s > best_tokens_per_s * (1 + 1e-6):
        return True
    return tokens_per_s >= best_tokens_per_s * (1 - 1e-6) and block < best_block


def _snap(x: np.ndarray) -> np.ndarray:
    """Clip to [0, 1], snap near-0/near-1 values and keep gpu + cpu <= 1 per class."""
    x = np.clip(x, 0.0, 1.0)
    x = np.where(x < _SNAP, 0.0, np.where(x > 1 - _SNAP, 1.0, x))
    for i in range(0, NUM_VARS, 2):
        if x[i] + x[i + 1] > 1 - _SNAP:                    # no disk share: make it exactly zero
            x[i + 1] = 1.0 - x[i]
    return np.round(x, 6)


def search(
    config: ModelConfig,
    workload: Workload,
    budgets: Budgets,
    profile: HardwareProfile,
    *,
    bytes_per_element: int = 2,
    compress_weights: bool = False,
    compress_cache: bool = False,
    cpu_attention: bool | None = None,
    overlap: bool = True,
    gpu_batch_sizes: Sequence[int] = GPU_BATCH_SIZES,
    num_gpu_batches: Sequence[int] = NUM_GPU_BATCHES,
    relax_gpu: float = 0.9,
    relax_cpu: float = 0.9,
    relax_disk: float = 0.95,
    model_name: str = "model",
) -> PolicyEstimate:
    """The policy with the highest predicted throughput that fits `budgets` (bytes) under the cost model.

    `relax_*` scale each budget (head-room for allocator rounding and fragmentation); `cpu_attention`
    None tries both. Raises NoFeasiblePolicy, saying what does not fit, when no shape fits.
    """
    relax = {"gpu": relax_gpu, "cpu": relax_cpu, "disk": relax_disk}
    flag_sets = [False, True] if cpu_attention is None else [cpu_attention]
    best: tuple[float, int, Policy, CostTerms, np.ndarray] | None = None
    infeasible_from: dict[tuple[int, bool], int] = {}       # (k, cpu_att) -> smallest infeasible g
    for g, k in candidate_shapes(workload.num_prompts, gpu_batch_sizes, num_gpu_batches):
        for cpu_att in flag_sets:
            if g >= infeasible_from.get((k, cpu_att), g + 1):
                continue                                    # memory only grows with g: also infeasible
            shape = Policy(gpu_batch_size=g, num_gpu_batches=k, overlap=overlap, cpu_attention=cpu_att,
                           compress_weights=compress_weights, compress_cache=compress_cache)
            terms = cost_terms(config, shape, workload, profile, bytes_per_element)
            x = _solve(terms, budgets, relax)
            if x is None:
                infeasible_from[(k, cpu_att)] = g
                continue
            x = _snap(x)
            tokens_per_s = estimate_terms(terms, x).tokens_per_s
            if best is None or _better(tokens_per_s, shape.block_size, best[0], best[1]):
                best = (tokens_per_s, shape.block_size, shape, terms, x)
    if best is None:
        raise NoFeasiblePolicy(_no_fit_message(config, workload, budgets, relax, bytes_per_element,
                                               compress_weights, compress_cache, model_name))
    _, _, shape, terms, x = best
    policy = replace(shape, **{name: float(v) for name, v in zip(VARS, x)})
    result = estimate_terms(terms, x)
    context = {
        "model": model_name, "device_name": profile.device_name, "profile_source": profile.source,
        "workload": workload_dict(workload),
        "budgets_bytes": {t: budgets.of(t) for t in TIERS},
    }
    return PolicyEstimate(policy, result.tokens_per_s, result.prefill_s, result.decode_s,
                          result.peak_memory_bytes,
                          {"prefill": result.prefill_bottleneck, "decode": result.decode_bottleneck}, context)


def _no_fit_message(config: ModelConfig, workload: Workload, budgets: Budgets, relax: dict[str, float],
                    bytes_per_element: int, compress_weights: bool, compress_cache: bool, model_name: str) -> str:
    """Why nothing fits: the smallest block's needs (all tiers together, and the gpu's working set)
    against the relaxed budgets."""
    B = bytes_per_element
    weights = (ms.layer_weight_bytes(config, B, compress_weights) * config.num_hidden_layers
               + ms.edge_weight_bytes(config, B))
    s = workload.memory_prompt_len + workload.gen_len
    cache = config.num_hidden_layers * s * ms.kv_bytes_per_token(config, B, compress_cache)
    usable = {t: relax[t] * budgets.of(t) for t in TIERS}
    stage = ms.largest_stage_bytes(config, B, compress_weights)
    parts = [
        f"no policy fits {model_name} ({format_size(weights)} of weights"
        + (" at 4-bit" if compress_weights else f" at {8 * B}-bit") + f", {format_size(cache)} of KV cache per "
        f"sequence of {s} tokens) in the budgets: "
        + ", ".join(f"{t} {format_size(budgets.of(t))} (usable {format_size(usable[t])})" for t in TIERS)
    ]
    if 2 * stage > usable["gpu"]:
        parts.append(f"the GPU budget cannot hold two in-flight copies of the largest layer "
                     f"({format_size(2 * stage)})")
    if weights + cache > sum(usable.values()):
        parts.append(f"weights + one sequence's cache need {format_size(weights + cache)} but all tiers "
                     f"together offer {format_size(sum(usable.values()))}; add CPU memory or a disk budget"
                     + ("" if compress_weights else ", or compress weights"))
    elif budgets.disk_bytes == 0 and weights > usable["gpu"] + usable["cpu"]:
        parts.append("the weights do not fit in GPU + CPU memory and the disk budget is 0")
    return "; ".join(parts)
