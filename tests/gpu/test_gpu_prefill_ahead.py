"""The ahead prefill on CUDA (skipped without a GPU): the next block's row chunks run on the running block's
decode steps, their cache stored to host homes (the gpu share parked) while that block's own loads and
stores are in flight, and moved to the device at the switch; the tokens must be the block-by-block run's."""
from __future__ import annotations

import pytest
import torch

from engine.models.loader import load_model
from engine.policy.policy import Policy
from engine.runtime.executor import Executor
from helpers.greedy_runs import GreedyRecorder, make_prompts
from helpers.skips import requires_cuda

pytestmark = requires_cuda

POLICIES = {
    "cache_split_4bit_streamed": dict(w_gpu=0.0, w_cpu=1.0, cache_gpu=0.5, cache_cpu=0.5, compress_weights=True,
                                      compress_cache=True),
    "cache_all_gpu": dict(w_gpu=0.0, w_cpu=1.0, cache_gpu=1.0, cache_cpu=0.0),
    "cache_cpu_attention": dict(w_gpu=0.5, w_cpu=0.5, cache_gpu=0.0, cache_cpu=1.0, cpu_attention=True),
    "one_batch_split": dict(gpu_batch_size=6, num_gpu_batches=1, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.25,
                            cache_cpu=0.75, compress_cache=True),
}


def run_blocks(loaded, policy: Policy, blocks, dtype=torch.float32, **kw) -> tuple[list[dict], list[float]]:
    """Each block's tokens (row -> tokens) and its `prefill_ahead` flag, from one executor on CUDA."""
    ex = Executor(loaded, policy, device=torch.device("cuda"), dtype=dtype, **kw)
    sels, flags = [GreedyRecorder() for _ in blocks], []
    try:
        for _ in ex.generate_blocks([(p, m, s) for (p, m), s in zip(blocks, sels)]):
            flags.append(ex.stats["prefill_ahead"])
    finally:
        ex.close()
    return [s.tokens for s in sels], flags


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("kind", ["llama", "opt", "mixtral"])
def test_cuda_ahead_prefill_matches_block_by_block(tiny_checkpoints, kind, name):
    loaded = load_model(tiny_checkpoints[kind], dtype=torch.float32)
    V = loaded.config.vocab_size
    blocks = [(make_prompts(6, V, seed=s), [5, 9, 3, 9, 7, 2]) for s in (1, 2, 3)]
    base = {"gpu_batch_size": 3, "num_gpu_batches": 2, **POLICIES[name]}
    ref, off = run_blocks(loaded, Policy(**base), blocks)
    got, on = run_blocks(loaded, Policy(**base, prefill_ahead=True), blocks)
    assert off == [0.0, 0.0, 0.0] and on == [0.0, 1.0, 1.0]
    assert got == ref


def shared(V: int, seed: int, prefix_len: int, n: int = 6) -> list[list[int]]:
    """`n` prompts sharing their first `prefix_len` tokens, then 1-7 of their own."""
    prefix = make_prompts(1, V, seed=seed, lo=prefix_len, hi=prefix_len + 1)[0]
    return [prefix + p for p in make_prompts(n, V, seed=seed + 1, lo=1, hi=8)]


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_cuda_ahead_prefill_with_a_shared_prefix_matches(tiny_checkpoints, kind, name):
    """Blocks whose GPU batches share 40-48 leading tokens (held once on the device): their prefixes run ahead
    in the pass of each batch's first rows and move to the block's prefix buffers at the switch."""
    loaded = load_model(tiny_checkpoints[kind], dtype=torch.float32)
    V = loaded.config.vocab_size
    blocks = [(shared(V, 40, 40), [5, 9, 3, 9, 7, 2]), (shared(V, 50, 48), [5, 9, 3, 9, 7, 2]),
              (make_prompts(6, V, seed=3), [4] * 6), (shared(V, 60, 44), [4] * 6)]
    base = {"gpu_batch_size": 3, "num_gpu_batches": 2, **POLICIES[name]}
    ref, off = run_blocks(loaded, Policy(**base), blocks)
    got, on = run_blocks(loaded, Policy(**base, prefill_ahead=True), blocks)
    assert off == [0.0] * 4 and on == [0.0, 1.0, 1.0, 1.0]
    assert got == ref


def test_cuda_ahead_prefill_at_scale_matches():
    """A 1.3B-parameter shape in fp16 (4-bit weights streamed from the host, 4-bit cache split), rows long
    enough that each pass is cut into several chunks: the same tokens with and without the ahead prefill."""
    loaded = load_model("opt-1.3b", dtype=torch.float16)
    blocks = [(make_prompts(16, loaded.config.vocab_size, seed=s, lo=200, hi=400), [12] * 16) for s in (5, 6, 7)]
    base = dict(gpu_batch_size=8, num_gpu_batches=2, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.4, cache_cpu=0.6,
                compress_weights=True, compress_cache=True)
    ref, _ = run_blocks(loaded, Policy(**base), blocks, torch.float16, prefill_chunk_tokens=256)
    got, on = run_blocks(loaded, Policy(**base, prefill_ahead=True), blocks, torch.float16, prefill_chunk_tokens=256)
    assert on == [0.0, 1.0, 1.0]
    assert got == ref
