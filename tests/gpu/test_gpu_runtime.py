"""The offload matrix on CUDA (fp32, tiny checkpoints) and the hard gpu budget (skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

from engine.models.loader import load_model
from engine.policy.policy import Policy
from helpers.greedy_runs import run_policy
from helpers.offload_matrix import BASE, MATRIX, in_memory_runs
from helpers.skips import requires_cuda

pytestmark = requires_cuda


@pytest.fixture(scope="module")
def cuda_reference(tiny_checkpoints):
    return in_memory_runs(tiny_checkpoints, device="cuda")


@pytest.mark.parametrize("name", list(MATRIX) + ["compress_all"])
@pytest.mark.parametrize("kind", ["llama", "opt", "mixtral"])
def test_cuda_policy_matches_reference(cuda_reference, kind, name, tmp_path):
    loaded, prompts, max_new, tokens = cuda_reference[kind]
    if name == "compress_all":
        policy = Policy(**BASE, w_gpu=0.3, w_cpu=0.5, cache_gpu=0.5, cache_cpu=0.5, compress_weights=True,
                        compress_cache=True)
        got, _ = run_policy(loaded, policy, prompts, max_new, device="cuda", disk_dir=tmp_path)
        assert [len(got[r]) for r in range(len(prompts))] == max_new
        return
    got, _ = run_policy(loaded, Policy(**{**BASE, **MATRIX[name]}), prompts, max_new, device="cuda",
                        disk_dir=tmp_path)
    assert got == tokens


@pytest.mark.parametrize("kind", ["llama", "opt", "mixtral"])
def test_cuda_streamed_4bit_weights_match_resident(cuda_reference, kind, tmp_path):
    """4-bit weights streamed from the host and the disk (a layer's copy waits only for its buffer's last
    dequantization, `engine.runtime.weight_homes`) give the tokens of the same 4-bit weights resident."""
    loaded, prompts, max_new, _ = cuda_reference[kind]
    runs = [run_policy(loaded, Policy(**{**BASE, **place}, compress_weights=True), prompts, max_new,
                       device="cuda", disk_dir=tmp_path)[0]
            for place in (dict(w_gpu=1.0), dict(w_gpu=0.0, w_cpu=1.0), dict(w_gpu=0.0, w_cpu=0.5),
                          dict(gpu_batch_size=9, num_gpu_batches=1, w_gpu=0.0, w_cpu=1.0))]
    assert all(r == runs[0] for r in runs[1:])


@pytest.mark.parametrize("name", ["cache_cpu", "cache_split", "cache_disk", "no_overlap_all_off"])
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_cuda_positions_major_4bit_homes_match(cuda_reference, kind, name, tmp_path):
    """A 4-bit cache loaded from positions-major host or disk homes (one pitched run per row, the fused
    kernel reading the loaded copy by its strides) gives the tokens of the 4-bit cache on the device."""
    loaded, prompts, max_new, _ = cuda_reference[kind]
    base = {**BASE, "compress_cache": True}
    ref, _ = run_policy(loaded, Policy(**base), prompts, max_new, device="cuda")
    got, _ = run_policy(loaded, Policy(**{**base, **MATRIX[name]}), prompts, max_new, device="cuda",
                        disk_dir=tmp_path)
    assert got == ref


def test_cuda_matches_cpu(cuda_reference):
    loaded, prompts, max_new, tokens = cuda_reference["llama"]
    cpu, _ = run_policy(loaded, Policy(**BASE), prompts, max_new)
    assert cpu == tokens


@pytest.mark.parametrize("policy", [
    dict(w_gpu=0.0, w_cpu=1.0, cache_gpu=1.0),
    dict(w_gpu=0.2, w_cpu=0.8, cache_gpu=0.0, cache_cpu=1.0, cpu_attention=True),
    dict(w_gpu=0.5, w_cpu=0.5, cache_gpu=0.5, cache_cpu=0.5, compress_weights=True, compress_cache=True),
])
def test_peak_device_memory_within_budget(policy):
    loaded = load_model("opt-1.3b", dtype=torch.float16)
    budget = 2 << 30
    prompts = [[7] * 256 for _ in range(16)]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    tokens, ex = run_policy(loaded, Policy(gpu_batch_size=8, num_gpu_batches=2, **policy), prompts, [8] * 16,
                            device="cuda", dtype=torch.float16, gpu_memory=budget)
    peak = torch.cuda.max_memory_allocated() - base
    assert len(tokens) == 16
    assert peak <= budget, f"peak {peak / 2**20:.0f} MiB > budget {budget / 2**20:.0f} MiB"
