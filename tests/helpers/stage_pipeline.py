"""Blocks through one executor or through a pipeline of stage executors (one stage per listed device), to
compare their greedy tokens; `POLICIES`: the offloading policies those comparisons run under."""
from __future__ import annotations

import torch

from engine.policy.partition import partition_model
from engine.runtime.executor import Executor
from engine.runtime.pipeline import Pipeline
from engine.runtime.stage_executor import StageExecutor
from helpers.greedy_runs import GreedyRecorder

POLICIES = {
    "all_in_memory": dict(),
    "w_cpu_cache_cpu_attn": dict(w_gpu=0.0, w_cpu=1.0, cache_gpu=0.0, cache_cpu=1.0, cpu_attention=True),
    "w_disk_cache_split": dict(w_gpu=0.2, w_cpu=0.3, cache_gpu=0.5, cache_cpu=0.5),
    "act_cpu_disk_no_overlap": dict(act_gpu=0.25, act_cpu=0.25, cache_gpu=0.0, cache_cpu=0.0, overlap=False),
}


def micro_blocks(prompts, max_new, block_size):
    """The rows cut into blocks of `block_size`: [(prompts, max_new)] per block."""
    return [(prompts[s:s + block_size], max_new[s:s + block_size]) for s in range(0, len(prompts), block_size)]


def one_executor(loaded, policy, blocks, stop_ids, disk_dir, device="cpu"):
    """Each block through one executor on `device`: the tokens per block."""
    ex = Executor(loaded, policy, device=torch.device(device), dtype=torch.float32, disk_dir=disk_dir)
    try:
        out = []
        for prompts, max_new in blocks:
            sel = GreedyRecorder(stop_ids)
            ex.generate_block(prompts, max_new, sel)
            out.append(sel.tokens)
        return out
    finally:
        ex.close()


def pipeline_tokens(loaded, policy, blocks, stop_ids, disk_dir, devices):
    """The blocks as the micro-batches of a pipeline with one stage per entry of `devices`: tokens per block."""
    stages = partition_model(loaded.config, len(devices), 4, compress=False)
    pipe = Pipeline([StageExecutor(loaded, policy, st, device=torch.device(dev), dtype=torch.float32,
                                   disk_dir=disk_dir / f"stage{st.index}") for st, dev in zip(stages, devices)])
    try:
        selectors = [GreedyRecorder(stop_ids) for _ in blocks]
        pipe.generate([(p, n, sel) for (p, n), sel in zip(blocks, selectors)])
        return [sel.tokens for sel in selectors]
    finally:
        pipe.close()
