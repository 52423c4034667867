"""On CUDA: what the executor allocates is the memory model's buffer plan, name for name and byte for byte
(pinned staging, relays, host-attention staging and the embedding and head held on the device included), and
the device's real peak stays within the budget the memory model gives (the plan's gpu bytes, the working
memory and the device memory the executor uses without reserving it), for the grid of policies on a small
model of each kind (skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

from helpers.buffer_plans import GRID, differences, family, planned, run, weight_file_bytes
from helpers.skips import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]

PROMPT, GEN = 96, 6
SIZES = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             vocab_size=4096)
KINDS = {"llama": SIZES, "mixtral": {**SIZES, "intermediate_size": 512}, "deepseek": {}}


@pytest.mark.parametrize("name", sorted(KINDS))
@pytest.mark.parametrize("case", sorted(GRID))
def test_cuda_allocates_the_plan_within_its_budget(name, case, tmp_path):
    policy, prefix, blocks = GRID[case]
    loaded = family(name, 4, torch.float16, **KINDS[name])
    plan, memory, peak = planned(loaded, policy, prefix, blocks, "cuda", 2, PROMPT, GEN)
    torch.ones(64, 64, dtype=torch.float16, device="cuda") @ torch.ones(64, 64, dtype=torch.float16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    held, asked, report = run(loaded, policy, prefix, blocks, torch.device("cuda"), tmp_path, torch.float16,
                       gpu_memory=peak["gpu"], prompt_len=PROMPT, gen_len=GEN)
    device_peak = torch.cuda.max_memory_allocated() - base
    assert differences(held, asked, plan) == []
    assert report["gpu"]["peak"] == memory["gpu"] and report["cpu"]["peak"] == memory["cpu"]
    assert report["disk"]["peak"] == memory["disk"] - weight_file_bytes(plan)
    assert device_peak <= peak["gpu"], f"device peak {device_peak} > the memory model's {peak['gpu']}"
