"""The choice itself: the cost model's policy for one workload under resolved budgets, and its refinement by trials.

On a CUDA profile the policy comes from `search()` (the LP over placement, deterministic for its inputs);
`refine` runs the `trials` best distinct candidates of `search_top` for one short block each on 2- and
6-layer copies of the model (`engine.calibrate.trial`) and keeps the best measured one, bounded by its
prediction. On a CPU device the gpu tier *is* host RAM, so there is nothing to place: everything stays on
the gpu tier and the batch is the largest that fits the budget, capped at `CPU_MAX_BATCH` and at the
number of prompts. `choose_policy_estimate` is the same choice for callers that hold settings rather than
budgets (benchmark harnesses): it resolves them by the one rule (`settings.resolve_budgets`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from engine.calibrate.planning.settings import PlanSettings, planning_profile, resolve_budgets
from engine.calibrate.planning.workload import prompts_prefix_len, workload_from_prompts
from engine.calibrate.trial import best_by_trials
from engine.models.config import ModelConfig
from engine.policy import model_stats as ms
from engine.policy.cost_model import Workload, estimate
from engine.policy.estimate import Budgets, NoFeasiblePolicy, PolicyEstimate, workload_dict
from engine.policy.hardware import HardwareProfile
from engine.policy.layout import ModelLayout
from engine.policy.policy import Policy
from engine.policy.search import search, search_top
from engine.runtime.layout import model_layout
from engine.util.sizes import format_size

CPU_MAX_BATCH = 128
CPU_RELAX = 0.85    # share of the CPU budget the heuristic lets weights + cache + working buffers use


def cpu_estimate(config: ModelConfig, workload: Workload, bytes_per_element: int, budget: int,
                 compress_weights: bool, compress_cache: bool, profile: HardwareProfile,
                 model_name: str, layout: ModelLayout) -> PolicyEstimate:
    """Everything on the gpu tier (host RAM); the largest batch that fits `budget` bytes. `layout`: the
    model's (`engine.runtime.layout.model_layout`)."""
    B = bytes_per_element
    weights = ms.layer_weight_bytes(config, B, compress_weights) * config.num_hidden_layers
    weights += ms.edge_weight_bytes(config, B)
    s = workload.memory_prompt_len
    per_seq = config.num_hidden_layers * (s + workload.gen_len) * ms.kv_bytes_per_token(config, B, compress_cache)
    # one sequence's prefill intermediates: qkv, attention output and scores, MLP, logits (fp32)
    per_seq += s * (4 * config.num_attention_heads * config.head_dim + 2 * config.intermediate_size) * B
    per_seq += config.num_attention_heads * s * s * B + config.vocab_size * 4
    room = CPU_RELAX * budget - weights
    if room < per_seq:
        raise NoFeasiblePolicy(
            f"no policy fits {model_name} on the CPU: weights need {format_size(weights)} and one sequence of "
            f"{s + workload.gen_len} tokens {format_size(per_seq)}, but the memory budget is "
            f"{format_size(budget)} (usable {format_size(CPU_RELAX * budget)})"
        )
    batch = int(min(CPU_MAX_BATCH, workload.num_prompts or CPU_MAX_BATCH, room // per_seq))
    policy = Policy(gpu_batch_size=batch, num_gpu_batches=1, compress_weights=compress_weights,
                    compress_cache=compress_cache)
    est = estimate(config, policy, workload, profile, B, layout=layout)
    context = {"model": model_name, "device_name": profile.device_name, "device_type": profile.device_type,
               "profile_source": profile.source, "workload": workload_dict(workload),
               "budgets_bytes": {"gpu": budget, "cpu": 0, "disk": 0}}
    return PolicyEstimate(policy, est.tokens_per_s, est.prefill_s, est.decode_s, est.peak_memory_bytes,
                          {"prefill": est.prefill_bottleneck, "decode": est.decode_bottleneck}, context)


def cost_model_choice(config: ModelConfig, workload: Workload, budgets: Budgets, profile: HardwareProfile, *,
                      dtype: torch.dtype, compress_weights: bool | None, compress_cache: bool | None,
                      model_name: str, layout: ModelLayout) -> PolicyEstimate:
    """The cost model's policy (deterministic): the closed form on a CPU profile, else the search.
    `layout`: the model's (`engine.runtime.layout.model_layout`). Raises NoFeasiblePolicy naming what does
    not fit."""
    B = ms.dtype_bytes(dtype)
    if profile.device_type != "cuda":
        return cpu_estimate(config, workload, B, budgets.gpu_bytes, bool(compress_weights), bool(compress_cache),
                            profile, model_name, layout)
    return search(config, workload, budgets, profile, bytes_per_element=B, compress_weights=compress_weights,
                  compress_cache=compress_cache, model_name=model_name, layout=layout)


def refine(config: ModelConfig, workload: Workload, budgets: Budgets, profile: HardwareProfile, *,
           device: torch.device, dtype: torch.dtype, compress_weights: bool | None, compress_cache: bool | None,
           model_name: str, layout: ModelLayout, trials: int, trial_time_s: float = 60.0,
           disk_dir: Path | None = None) -> PolicyEstimate:
    """The best of the cost model's `trials` best candidates, measured on `device` within about
    `trial_time_s` seconds; the estimate holds the extrapolated measurement and the cost model's prediction
    (`context["predicted"]`, `context["trials"]`)."""
    candidates = search_top(config, workload, budgets, profile, top=trials, bytes_per_element=ms.dtype_bytes(dtype),
                            compress_weights=compress_weights, compress_cache=compress_cache, model_name=model_name,
                            layout=layout)
    return best_by_trials(config, candidates, workload, device, dtype, budgets, time_budget_s=trial_time_s,
                          disk_dir=disk_dir)


def choose_policy_estimate(
    config: ModelConfig,
    *,
    prompt_lens: Sequence[int] = (),
    prompts: Sequence[Sequence[int]] = (),
    max_new_tokens: int = 1,
    workload: Workload | None = None,
    device: torch.device | str,
    dtype: torch.dtype,
    gpu_memory: int | None,
    cpu_memory: int | None,
    disk_memory: int | None = None,
    compress_weights: bool | None = False,
    compress_cache: bool | None = False,
    profile: HardwareProfile | None = None,
    model_name: str = "model",
    trials: int = 0,
    trial_time_s: float = 60.0,
    disk_dir: Path | None = None,
    num_devices: int = 1,
) -> PolicyEstimate:
    """The policy for `workload` (else the exact workload of `prompts` token ids or `prompt_lens`, and
    `max_new_tokens`) on `device`, with the budgets `resolve_budgets` gives these settings and `profile`
    (default: `planning_profile(device)`); refined by `trials` on CUDA. Unbucketed and uncached: the facade
    plans through `Planner`."""
    device = torch.device(device)
    if workload is None:
        lens = [len(p) for p in prompts] if prompts else prompt_lens
        workload = workload_from_prompts(lens, max_new_tokens, prompts_prefix_len(prompts))
    profile = profile or planning_profile(device)
    settings = PlanSettings(gpu_memory=gpu_memory, cpu_memory=cpu_memory, disk_memory=disk_memory, disk_dir=disk_dir,
                            num_devices=num_devices, compress_weights=compress_weights, compress_cache=compress_cache)
    budgets = resolve_budgets(profile, settings)
    kwargs: dict[str, Any] = dict(dtype=dtype, compress_weights=compress_weights, compress_cache=compress_cache,
                                  model_name=model_name, layout=model_layout(config, dtype))
    if trials <= 0 or device.type != "cuda":
        return cost_model_choice(config, workload, budgets, profile, **kwargs)
    return refine(config, workload, budgets, profile, device=device, trials=trials, trial_time_s=trial_time_s,
                  disk_dir=disk_dir, **kwargs)


def choose_policy(config: ModelConfig, **kwargs: Any) -> Policy:
    """`choose_policy_estimate(config, **kwargs).policy`."""
    return choose_policy_estimate(config, **kwargs).policy
