"""The cost model's memory against the executor's own accounting: a few policies on tiny presets, one block run
under hard budgets set from the prediction, and the budgets' failure just below what the executor counts."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.calibrate.trial import truncated_model
from engine.models.hf_config import config_from_hf
from engine.models.presets import PRESETS
from engine.policy.cost_model import Workload, estimate
from engine.policy.memory import executor_memory
from engine.policy.policy import Policy
from engine.runtime.executor import Executor
from engine.runtime.layout import model_layout
from engine.storage.tiers import BudgetExceeded
from helpers.greedy_runs import RunToEnd

WORKLOAD = Workload(prompt_len=7, gen_len=4)
PREFIXED = replace(WORKLOAD, shared_prefix_len=5)
POLICIES = [
    Policy(gpu_batch_size=2),
    Policy(gpu_batch_size=2, num_gpu_batches=3, w_gpu=0.3, w_cpu=0.4, cache_gpu=0.5, cache_cpu=0.25,
           act_gpu=0.5, act_cpu=0.25),
    Policy(gpu_batch_size=3, num_gpu_batches=2, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.0, cache_cpu=1.0,
           cpu_attention=True, compress_weights=True, compress_cache=True),
    Policy(gpu_batch_size=1, num_gpu_batches=2, w_gpu=0.6, w_cpu=0.0, cache_gpu=0.5, cache_cpu=0.0,
           compress_cache=True),
    Policy(gpu_batch_size=2, cache_gpu=0.5, cache_cpu=0.5),         # one GPU batch: stores alternate buffers
    # three more tensors on the gpu: both attention layers' (their buffer goes) and the first MLP's (it stays)
    Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu=0.2, w_cpu=0.4, w_gpu_extra=3, cache_gpu=0.5, cache_cpu=0.5),
]


def preset(name):
    """The ModelConfig of preset `name` (engine/models/presets.py)."""
    return config_from_hf(PRESETS[name])


def run_block(name, policy, device, gpu_memory, cpu_memory, disk_dir, workload=WORKLOAD):
    """One block of `policy` on the tiny preset's real executor under the given hard budgets: prompts of
    `workload.prompt_len` tokens, the first `workload.shared_prefix_len` of them the same in every row."""
    loaded = truncated_model(preset(name), 2, torch.float32)
    ex = Executor(loaded, policy, device=device, dtype=torch.float32, gpu_memory=gpu_memory,
                  cpu_memory=cpu_memory, disk_dir=disk_dir)
    try:
        p = workload.shared_prefix_len
        prompts = [[3 + (t if t < p else r + t) % 50 for t in range(workload.prompt_len)]
                   for r in range(policy.block_size)]
        ex.generate_block(prompts, [workload.gen_len] * policy.block_size, RunToEnd())
        return ex.memory_report()
    finally:
        ex.close()


def weights_on_disk(config, policy, device_type="cpu"):
    """Bytes of the weight files on disk (the arena's disk budget holds the cache and hidden homes only)."""
    layout = model_layout(config, 4, policy.compress_weights)
    placed = layout.placed(policy.w_gpu, policy.w_cpu, device_type, policy.w_gpu_extra)
    return sum(count * size for kl in layout.kinds for tiers, count in placed[id(kl)]
               for size, tier in zip(kl.stored, tiers) if tier == "disk")


def check_budget_consistency(name, policy, device, profile, tmp_path, workload=WORKLOAD):
    """The cost model's peak bytes bound the executor's counted gpu bytes and equal its cpu and disk bytes; a
    block under budgets just above the prediction peaks at exactly the counted bytes (disk: less the weight
    files); budgets of 97% of the counted gpu (cpu) bytes raise BudgetExceeded."""
    config = preset(name)
    predicted = estimate(config, policy, workload, profile, 4, layout=model_layout(config)).peak_memory_bytes
    counted = executor_memory(config, model_layout(config, 4, policy.compress_weights), policy,
                              workload.prompt_len, workload.gen_len, 4, device.type,
                              shared_prefix_len=workload.shared_prefix_len)
    assert predicted["gpu"] >= counted["gpu"] and predicted["cpu"] == counted["cpu"]
    assert predicted["disk"] == counted["disk"]
    report = run_block(name, policy, device, predicted["gpu"] + 1024, predicted["cpu"] + 1024, tmp_path, workload)
    assert report["gpu"]["peak"] == counted["gpu"] and report["cpu"]["peak"] == counted["cpu"]
    assert report["disk"]["peak"] == counted["disk"] - weights_on_disk(config, policy, device.type)  # files
    with pytest.raises(BudgetExceeded):
        run_block(name, policy, device, int(0.97 * counted["gpu"]), None, tmp_path, workload)
    if counted["cpu"] > 0:
        with pytest.raises(BudgetExceeded):
            run_block(name, policy, device, None, int(0.97 * counted["cpu"]), tmp_path, workload)
