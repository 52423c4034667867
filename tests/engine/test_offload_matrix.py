"""Every placement/flag policy gives the same greedy tokens as the all-in-memory run (CPU, fp32)."""
from __future__ import annotations

import pytest
import torch

from engine.models.loader import load_model
from engine.policy.policy import Policy
from engine.quant.config import QuantConfig
from engine.runtime.arena import Arena
from engine.runtime.kv_cache import KVHome
from engine.storage.tiers import MemoryBudget, Tier
from helpers.greedy_runs import make_prompts, run_policy
from helpers.offload_matrix import BASE, MATRIX, in_memory_runs
from helpers.skips import requires_smollm2


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    return in_memory_runs(tiny_checkpoints)


@pytest.mark.parametrize("kind", ["llama", "opt", "mixtral"])
def test_batch_shapes_agree(reference, kind):
    loaded, prompts, max_new, tokens = reference[kind]
    one, _ = run_policy(loaded, Policy(gpu_batch_size=9, num_gpu_batches=1), prompts, max_new)
    assert one == tokens
    assert [len(tokens[r]) for r in range(9)] == max_new


@pytest.mark.parametrize("name", list(MATRIX))
@pytest.mark.parametrize("kind", ["llama", "opt", "mixtral"])
def test_policy_matches_reference(reference, kind, name, tmp_path):
    loaded, prompts, max_new, tokens = reference[kind]
    policy = Policy(**{**BASE, **MATRIX[name]})
    got, ex = run_policy(loaded, policy, prompts, max_new, disk_dir=tmp_path)
    assert got == tokens


def test_stop_rows_compact_and_match(reference, tmp_path):
    """Rows finished by the selector stop early (compaction) and the others are unaffected."""
    loaded, prompts, max_new, tokens = reference["llama"]
    stop = {tokens[0][1], tokens[4][2]}
    got, _ = run_policy(loaded, Policy(**BASE), prompts, max_new, stop_ids=tuple(stop))
    off, _ = run_policy(loaded, Policy(**{**BASE, **MATRIX["no_overlap_all_off"]}), prompts, max_new,
                        stop_ids=tuple(stop), disk_dir=tmp_path)
    assert off == got
    for r, seq in got.items():
        cut = next((n + 1 for n, t in enumerate(tokens[r]) if t in stop), len(tokens[r]))
        assert seq == tokens[r][:cut]


@requires_smollm2
def test_smollm2_offloaded_matches():
    loaded = load_model("smollm2-135m-instruct", dtype=torch.float32)
    prompts = make_prompts(4, 40000, seed=5, lo=5, hi=12)
    max_new = [4, 4, 4, 4]
    ref, _ = run_policy(loaded, Policy(gpu_batch_size=2, num_gpu_batches=2), prompts, max_new)
    got, _ = run_policy(loaded, Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu=0.5, w_cpu=0.5, cache_gpu=0.0,
                                       cache_cpu=1.0, cpu_attention=True), prompts, max_new)
    assert got == ref


PREFIX_CASES = [("llama", "cache_disk"), ("llama", "cache_cpu_attn"), ("llama", "cache_split"),
                ("llama", "no_overlap_all_off"), ("llama", "cache_disk_attn"), ("opt", "cache_cpu"),
                ("mixtral", "cache_cpu_attn"), ("mixtral", "one_batch_all_off")]


@pytest.mark.parametrize("kind, name", PREFIX_CASES)
@pytest.mark.parametrize("compress", [False, True], ids=["dense", "4bit-cache"])
def test_shared_prefix_policies_match(tiny_checkpoints, kind, name, compress, tmp_path):
    """Rows sharing a prefix (held once per GPU batch, the rows' caches their own positions, rows finishing
    at different steps): every placement, host attention (Mixtral's pipelined too) and a 4-bit cache give
    the in-memory run's tokens."""
    loaded = load_model(tiny_checkpoints[kind], dtype=torch.float32)
    prefix = make_prompts(1, loaded.config.vocab_size, seed=21, lo=8, hi=9)[0]
    prompts = [prefix + p for p in make_prompts(9, loaded.config.vocab_size, seed=22, lo=1, hi=10)]
    max_new = [5, 2, 5, 4, 5, 5, 1, 5, 3]
    base = {**BASE, "compress_cache": compress}
    ref, _ = run_policy(loaded, Policy(**base), prompts, max_new)
    got, _ = run_policy(loaded, Policy(**{**base, **MATRIX[name]}), prompts, max_new, disk_dir=tmp_path)
    assert got == ref


def test_loaded_4bit_homes_are_held_positions_major():
    """A 4-bit cache home that decode loads to the device is memory [b, S, h, ...] (one run per row); a gpu
    home, a host-attended one and a dense one keep [b, h, S, hd]."""
    budget = MemoryBudget({Tier.GPU: None, Tier.CPU: None, Tier.DISK: None})
    quant = QuantConfig(bits=4, group_size=4)

    def home(cpu_attention: bool, q: QuantConfig | None) -> KVHome:
        return KVHome(Arena(torch.device("cpu"), budget, None), "kv", rows=3, length=10, num_kv_heads=4,
                      head_dim=8, dtype=torch.float32, cache_gpu=0.5, cache_cpu=0.5, quant=q,
                      cpu_attention=cpu_attention)
    on_gpu, on_cpu = home(False, quant).segments
    assert on_cpu.positions_major and not on_gpu.positions_major
    assert on_cpu.k.shape == on_gpu.k.shape == (3, 2, 10, 8)
    assert on_cpu.k.data.stride(2) > on_cpu.k.data.stride(1)          # positions outside heads in memory
    assert not any(s.positions_major for s in home(True, quant).segments + home(False, None).segments)


@pytest.mark.parametrize("name", ["cache_cpu", "cache_split", "cache_disk", "no_overlap_all_off"])
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_positions_major_4bit_homes_match(tiny_checkpoints, kind, name, tmp_path):
    """A 4-bit cache loaded from positions-major host or disk homes gives the 4-bit in-memory run's tokens,
    rows finishing at different steps (compaction) included."""
    loaded = load_model(tiny_checkpoints[kind], dtype=torch.float32)
    prompts = make_prompts(9, loaded.config.vocab_size, seed=7)
    max_new = [6, 9, 3, 9, 7, 9, 5, 9, 8]
    base = {**BASE, "compress_cache": True}
    ref, _ = run_policy(loaded, Policy(**base), prompts, max_new)
    got, _ = run_policy(loaded, Policy(**{**base, **MATRIX[name]}), prompts, max_new, disk_dir=tmp_path)
    assert got == ref
