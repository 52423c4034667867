"""The offloading policy matrix: every placement/flag variant of one base policy, and the all-in-memory runs
each variant's greedy tokens are compared with."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from engine.models.loader import load_model
from engine.policy.policy import Policy
from helpers.greedy_runs import make_prompts, run_policy

BASE = dict(gpu_batch_size=3, num_gpu_batches=3)
MATRIX = {
    "w_half_cpu": dict(w_gpu=0.5, w_cpu=0.5),
    "w_all_cpu": dict(w_gpu=0.0, w_cpu=1.0),
    "w_disk": dict(w_gpu=0.2, w_cpu=0.3),
    "w_disk_extra": dict(w_gpu=0.2, w_cpu=0.3, w_gpu_extra=3),
    "w_all_disk": dict(w_gpu=0.0, w_cpu=0.0),
    "cache_cpu": dict(cache_gpu=0.0, cache_cpu=1.0),
    "cache_split": dict(cache_gpu=0.5, cache_cpu=0.5),
    "cache_disk": dict(cache_gpu=0.0, cache_cpu=0.0),
    "cache_cpu_attn": dict(cache_gpu=0.0, cache_cpu=1.0, cpu_attention=True),
    "cache_disk_attn": dict(cache_gpu=0.5, cache_cpu=0.0, cpu_attention=True),
    "act_cpu_disk": dict(act_gpu=0.25, act_cpu=0.25),
    "no_overlap_all_off": dict(w_gpu=0.0, w_cpu=0.5, cache_gpu=0.0, cache_cpu=0.5, act_gpu=0.5, act_cpu=0.0,
                               overlap=False),
    "one_batch_all_off": dict(gpu_batch_size=9, num_gpu_batches=1, w_gpu=0.3, w_cpu=0.3, cache_gpu=0.0,
                              cache_cpu=0.5, cpu_attention=True),
}
MATRIX_KINDS = ("llama", "opt", "mixtral")      # the tiny checkpoints the whole matrix runs on
MAX_NEW = [6, 9, 3, 9, 7, 9, 5, 9, 8]           # one block of BASE's 9 rows, finishing at different steps


def in_memory_runs(folders: Mapping[str, Path], kinds: Iterable[str] = MATRIX_KINDS, device: str = "cpu") -> dict:
    """Per kind (a key of `folders`, checkpoint folders): (loaded, prompts, max_new, tokens of the BASE
    all-in-memory policy on `device`)."""
    out = {}
    for kind in kinds:
        loaded = load_model(folders[kind], dtype=torch.float32)
        prompts, max_new = make_prompts(9, loaded.config.vocab_size, seed=3), list(MAX_NEW)
        tokens, _ = run_policy(loaded, Policy(**BASE), prompts, max_new, device=device)
        out[kind] = (loaded, prompts, max_new, tokens)
    return out
