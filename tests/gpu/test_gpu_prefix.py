"""On CUDA: a block whose rows share a prompt prefix (computed once per GPU batch) stays inside the memory
model's device peak for that prefix, as one without a prefix does (skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

from engine.models.loader import load_model
from engine.policy.memory import peak_memory
from engine.policy.policy import Policy
from engine.runtime.layout import model_layout
from helpers.greedy_runs import run_policy
from helpers.skips import requires_cuda

pytestmark = requires_cuda

PROMPT, GEN = 256, 8


def prompts_sharing(prefix: int, rows: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, vocab, (prefix,), generator=gen).tolist()
    return [shared + torch.randint(3, vocab, (PROMPT - prefix,), generator=gen).tolist() for _ in range(rows)]


@pytest.mark.parametrize("prefix", [0, 192])
@pytest.mark.parametrize("placement", [
    dict(w_gpu=0.5, w_cpu=0.5),
    dict(w_gpu=0.0, w_cpu=1.0, cache_gpu=0.0, cache_cpu=1.0, act_gpu=0.0, act_cpu=1.0, compress_weights=True,
         compress_cache=True),
], ids=["resident", "offloaded-4bit"])
def test_device_peak_within_the_memory_model(prefix, placement):
    loaded = load_model("opt-1.3b", dtype=torch.float16)
    policy = Policy(gpu_batch_size=32, num_gpu_batches=3, **placement)
    c = loaded.config
    predicted = peak_memory(c, model_layout(c, 2, policy.compress_weights), policy, PROMPT, GEN, 2, "cuda",
                            shared_prefix_len=prefix)["gpu"]
    prompts = prompts_sharing(prefix, policy.block_size, c.vocab_size)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    tokens, _ = run_policy(loaded, policy, prompts, [GEN] * len(prompts), device="cuda", dtype=torch.float16,
                           gpu_memory=predicted)
    peak = torch.cuda.max_memory_allocated() - base
    assert len(tokens) == len(prompts)
    assert peak <= predicted, f"peak {peak / 2**20:.0f} MiB > predicted {predicted / 2**20:.0f} MiB"
