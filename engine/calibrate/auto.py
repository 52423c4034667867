"""`choose_policy`: the policy `LLM(policy="auto")` runs with, from the real workload and the budgets.

On a CUDA device the policy comes from `search()` with this machine's cached (or, once, measured) hardware
profile, refined by measured trials of the best few candidates when `trials` > 0 (`LLM` asks for 4).
On a CPU device the gpu tier *is* host RAM, so there is nothing to place: everything stays on the gpu tier
and the batch size is the largest that fits the memory budget, capped at `CPU_MAX_BATCH` and at the number
of prompts; no microbenchmark runs (a cached profile or a cheap default is used for the estimate).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import torch

from engine.calibrate.machine import default_cpu_budget, default_cpu_profile, host_memory_bytes
from engine.calibrate.profile_cache import load_cached_profile, load_or_measure
from engine.calibrate.trial import best_by_trials
from engine.models.config import ModelConfig
from engine.policy import model_stats as ms
from engine.policy.cost_model import Workload, estimate
from engine.policy.estimate import Budgets, NoFeasiblePolicy, PolicyEstimate, workload_dict
from engine.policy.hardware import HardwareProfile
from engine.policy.policy import Policy
from engine.policy.search import search, search_top
from engine.runtime.batch import shared_prefix_len
from engine.util.sizes import format_size

CPU_MAX_BATCH = 128
CPU_RELAX = 0.85    # share of the CPU budget the heuristic lets weights + cache + working buffers use


def prompts_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    """Leading tokens every one of the token `prompts` shares, by the executor's rule for a GPU batch
    (`engine.runtime.batch.shared_prefix_len`: each prompt keeps at least one token of its own); 0 for fewer
    than two prompts. The planner's `Workload.shared_prefix_len` (a GPU batch of these rows shares at least it)."""
    return shared_prefix_len([list(p) for p in prompts]) if len(prompts) > 1 else 0


def workload_from_prompts(prompt_lens: Sequence[int], max_new_tokens: int, shared_prefix_len: int = 0) -> Workload:
    """Mean prompt length for time, the longest for memory, the count as the block-size bound, and the
    leading tokens all prompts share (`prompts_prefix_len`)."""
    lens = [max(1, int(n)) for n in prompt_lens] or [1]
    return Workload(prompt_len=math.ceil(sum(lens) / len(lens)), gen_len=max(1, max_new_tokens),
                    num_prompts=len(lens), max_prompt_len=max(lens), shared_prefix_len=shared_prefix_len)


def _cpu_estimate(config: ModelConfig, workload: Workload, bytes_per_element: int, budget: int,
                  compress_weights: bool, compress_cache: bool, profile: HardwareProfile,
                  model_name: str) -> PolicyEstimate:
    """Everything on the gpu tier (host RAM); the largest batch that fits `budget`."""
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
    est = estimate(config, policy, workload, profile, B)
    context = {"model": model_name, "device_name": profile.device_name, "profile_source": profile.source,
               "workload": workload_dict(workload), "budgets_bytes": {"gpu": budget, "cpu": 0, "disk": 0}}
    return PolicyEstimate(policy, est.tokens_per_s, est.prefill_s, est.decode_s, est.peak_memory_bytes,
                          {"prefill": est.prefill_bottleneck, "decode": est.decode_bottleneck}, context)


def choose_policy_estimate(
    config: ModelConfig,
    *,
    prompt_lens: Sequence[int] = (),
    prompts: Sequence[Sequence[int]] = (),
    max_new_tokens: int = 1,
    workload: Workload | None = None,
    device: torch.device,
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
) -> PolicyEstimate:
    """Like `choose_policy`, returning the estimate (for logging and `explain()`).

    On CUDA with `trials` > 0, the `trials` best distinct candidates of `search_top` are each run for one
    short block on 2- and 6-layer copies of the model (`engine.calibrate.trial`), within about `trial_time_s`
    seconds, and the best measured one is returned; its estimate holds the extrapolated measurement and
    the cost model's prediction (`context["predicted"]`, `context["trials"]`). `compress_weights` /
    `compress_cache` None let the search decide (on CUDA; a CPU device never compresses then). `prompts`
    (token ids), when given, stand for `prompt_lens` and give the shared prefix too. `workload`, when
    given, is planned for instead of the one `prompt_lens` (or `prompts`) and `max_new_tokens` describe."""
    device = torch.device(device)
    if workload is None:
        lens = [len(p) for p in prompts] if prompts else prompt_lens
        workload = workload_from_prompts(lens, max_new_tokens, prompts_prefix_len(prompts))
    B = ms.dtype_bytes(dtype)
    if device.type != "cuda":
        budget = gpu_memory if gpu_memory is not None else (cpu_memory if cpu_memory is not None
                                                             else host_memory_bytes())
        profile = profile or load_cached_profile(device) or default_cpu_profile()
        return _cpu_estimate(config, workload, B, int(budget), bool(compress_weights), bool(compress_cache),
                             profile, model_name)
    profile = profile or load_or_measure(device)
    if gpu_memory is None:
        gpu_memory = torch.cuda.mem_get_info(device)[0]
    budgets = Budgets(gpu_bytes=int(gpu_memory),
                      cpu_bytes=int(cpu_memory if cpu_memory is not None else default_cpu_budget()),
                      disk_bytes=int(disk_memory or 0))
    kwargs = dict(bytes_per_element=B, compress_weights=compress_weights, compress_cache=compress_cache,
                  model_name=model_name)
    if trials <= 0:
        return search(config, workload, budgets, profile, **kwargs)
    candidates = search_top(config, workload, budgets, profile, top=trials, **kwargs)
    return best_by_trials(config, candidates, workload, device, dtype, budgets, time_budget_s=trial_time_s,
                          disk_dir=disk_dir)


def choose_policy(config: ModelConfig, **kwargs: Any) -> Policy:
    """The policy for running `config` over prompts of `prompt_lens` tokens, `max_new_tokens` each.

    Keyword arguments are `choose_policy_estimate`'s. Budgets are bytes (None: the device's free memory for
    the gpu; for the cpu, `engine.calibrate.machine.PINNED_SHARE` of the available RAM on CUDA, all of it on a CPU device;
    no disk). The batch never exceeds the number of prompts. Raises
    NoFeasiblePolicy (a ValueError) naming what does not fit. On CUDA the first call on a machine may run
    the ~1-minute hardware microbenchmark (then cached); on CPU no benchmark runs.
    """
    return choose_policy_estimate(config, **kwargs).policy


__all__ = ["choose_policy", "choose_policy_estimate", "prompts_prefix_len", "workload_from_prompts",
           "NoFeasiblePolicy"]
