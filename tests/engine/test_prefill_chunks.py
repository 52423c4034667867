"""Chunked prefill and chunked decode dequantization: same tokens and logits as unchunked; the working-memory
formula bounds (tightly) the tensors a block really allocates; OPT-30B 48 x 1 fits 16 GiB."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.calibrate.trial import truncated_model
from engine.models import moe
from engine.models.hf_config import config_from_hf
from engine.models.loader import load_model
from engine.models.presets import PRESETS
from engine.policy.cost_model import Workload
from engine.policy.estimate import Budgets
from engine.policy.hardware import reference_profile
from engine.policy.memory import peak_memory, untracked_gpu_bytes
from engine.policy.policy import Policy
from engine.policy.search import search
from engine.policy.working import _MARGIN, row_chunks, working_bytes
from engine.runtime.act_homes import ActHomes
from engine.runtime.arena import Arena
from engine.runtime.batch import GpuBatch
from engine.runtime.executor import Executor
from engine.runtime.kv_cache import KVHome
from engine.runtime.layout import expert_buffers, model_layout
from engine.runtime.selector import GreedyToEnd
from engine.storage.tiers import MemoryBudget, Tier
from helpers.greedy_runs import make_prompts, run_logits as run
from helpers.live_bytes import LiveBytes
from helpers.skips import requires_cuda

GIB = 1 << 30
POLICIES = {
    "all_gpu": dict(),
    "cache_cpu": dict(cache_gpu=0.0, cache_cpu=1.0),
    "cache_split_disk": dict(cache_gpu=0.5, cache_cpu=0.0),
    "cache_q_gpu": dict(compress_cache=True),
    "cache_q_cpu": dict(cache_gpu=0.0, cache_cpu=1.0, compress_cache=True),
    "cache_q_cpu_attn": dict(cache_gpu=0.0, cache_cpu=1.0, compress_cache=True, cpu_attention=True),
    "weights_q_act_cpu": dict(w_gpu=0.0, w_cpu=1.0, compress_weights=True, act_gpu=0.5, act_cpu=0.5),
}


def test_row_chunks_cover_the_batch():
    assert row_chunks(10, 3, 8) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert row_chunks(4, 100, 8) == [(0, 1), (1, 2), (2, 3), (3, 4)]     # at least one whole row
    assert row_chunks(4, 2, 4096) == [(0, 4)]


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("kind", ["llama", "opt", "mixtral"])
@pytest.mark.parametrize("shared_prefix", [False, True], ids=["plain", "prefix"])
def test_chunked_prefill_matches_unchunked(tiny_checkpoints, kind, name, shared_prefix, tmp_path):
    loaded = load_model(tiny_checkpoints[kind], dtype=torch.float32)
    prompts = make_prompts(7, loaded.config.vocab_size, seed=11, lo=3, hi=14)
    if shared_prefix:
        prompts = [make_prompts(1, loaded.config.vocab_size, seed=12, lo=6, hi=7)[0] + p for p in prompts]
    max_new = [4, 6, 2, 6, 5, 6, 3]
    policy = Policy(gpu_batch_size=7, num_gpu_batches=1, **POLICIES[name])
    ref = run(loaded, policy, prompts, max_new, tmp_path / "a", prefill_chunk_tokens=1 << 20)   # one chunk
    got = run(loaded, policy, prompts, max_new, tmp_path / "b", prefill_chunk_tokens=20, decode_chunk_bytes=1)
    assert got.tokens == ref.tokens
    for r in ref.logits:
        torch.testing.assert_close(torch.stack(got.logits[r]), torch.stack(ref.logits[r]), rtol=1e-5, atol=1e-5)


@requires_cuda
@pytest.mark.parametrize("name", ["all_gpu", "cache_q_cpu", "weights_q_act_cpu"])
@pytest.mark.parametrize("kind", ["llama", "opt", "mixtral"])
def test_chunked_prefill_matches_unchunked_on_cuda(tiny_checkpoints, kind, name, tmp_path):
    """On the GPU (fp32, SDPA's CUDA kernels): chunks of 20 tokens give the one-chunk run's greedy tokens."""
    loaded = load_model(tiny_checkpoints[kind], dtype=torch.float32)
    prompts = make_prompts(7, loaded.config.vocab_size, seed=11, lo=3, hi=14)
    max_new = [4, 6, 2, 6, 5, 6, 3]
    policy = Policy(gpu_batch_size=7, num_gpu_batches=1, **POLICIES[name])
    cuda = torch.device("cuda")
    ref = run(loaded, policy, prompts, max_new, tmp_path / "a", prefill_chunk_tokens=1 << 20, device=cuda)
    got = run(loaded, policy, prompts, max_new, tmp_path / "b", prefill_chunk_tokens=20, decode_chunk_bytes=1,
              device=cuda)
    assert got.tokens == ref.tokens
    for r in ref.logits:
        torch.testing.assert_close(torch.stack(got.logits[r]), torch.stack(ref.logits[r]), rtol=1e-4, atol=1e-4)


@requires_cuda
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_hidden_states_loaded_by_rows_give_the_in_memory_tokens_on_cuda(tiny_checkpoints, kind, tmp_path,
                                                                        monkeypatch):
    """Two GPU batches with the prefill's hidden states parked on the host come back by row chunks
    (`ActHomes._load_rows`: the compute of a chunk waits only for its rows); tokens and logits are the
    all-on-device run's."""
    loads = []
    by_rows = ActHomes._load_rows
    monkeypatch.setattr(ActHomes, "_load_rows", lambda self, *a: loads.append(a[-1]) or by_rows(self, *a))
    loaded = load_model(tiny_checkpoints[kind], dtype=torch.float32)
    prompts = make_prompts(8, loaded.config.vocab_size, seed=13, lo=5, hi=14)
    max_new = [4, 6, 2, 6, 5, 6, 3, 4]
    cuda = torch.device("cuda")
    ref = run(loaded, Policy(gpu_batch_size=4, num_gpu_batches=2), prompts, max_new, tmp_path / "a", device=cuda)
    got = run(loaded, Policy(gpu_batch_size=4, num_gpu_batches=2, act_gpu=0.0, act_cpu=1.0), prompts, max_new,
              tmp_path / "b", prefill_chunk_tokens=20, device=cuda)
    assert loads and all(len(rows) > 1 for rows in loads)
    assert got.tokens == ref.tokens
    for r in ref.logits:
        torch.testing.assert_close(torch.stack(got.logits[r]), torch.stack(ref.logits[r]), rtol=1e-4, atol=1e-4)


def measured_working(config, policy, b, s, gen, chunk_tokens, prefix=0, disk_dir=None):
    """Peak bytes of the tensors one block of b rows allocates outside the arena's homes and buffers (rows
    sharing their first `prefix` tokens)."""
    loaded = truncated_model(config, 2, torch.float32)
    ex = Executor(loaded, policy, device=torch.device("cpu"), dtype=torch.float32, prefill_chunk_tokens=chunk_tokens,
                  disk_dir=disk_dir)
    try:
        prompts = [[3 + (t if t < prefix else r * 7 + t) % 200 for t in range(s)] for r in range(b)]
        ex.generate_block(prompts[:1], [1], GreedyToEnd())      # the family's lazy RoPE table: not per batch
        with LiveBytes() as live:
            ex.generate_block(prompts, [gen] * b, GreedyToEnd())
        arena = {flat.untyped_storage().data_ptr() for _, flat in ex.arena._flat.values()}
        return live.peak(arena)
    finally:
        ex.close()


SMALL = dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             vocab_size=512)
WORKING_MODELS = {
    "llama": replace(config_from_hf(PRESETS["tiny-llama"]), **SMALL),
    # every token to every expert: any routing pads as much as the worst one, so the bound is reached
    "moe_every_expert": replace(config_from_hf(PRESETS["tiny-mixtral"]), **{**SMALL, "intermediate_size": 512},
                                num_local_experts=4, num_experts_per_tok=4),
}


def _predicted_and_measured(config, chunk_tokens, cache, prefix=0):
    b, s, gen = 16, 64, 3
    flags = dict(cache_gpu=0.0, cache_cpu=1.0, compress_cache=True) if cache == "cpu_q" else {}
    policy = Policy(gpu_batch_size=b, num_gpu_batches=1, **flags)
    staged = 2 if cache == "cpu_q" else 0
    predicted = working_bytes(config, b, s, s + gen - 1, torch.float32, cache == "cpu_q", staged, chunk_tokens,
                              prefix_len=prefix, experts=expert_buffers(config))
    rows = max(r1 - r0 for r0, r1 in row_chunks(b, s, chunk_tokens))
    heads = config.num_attention_heads       # CPU math SDPA's scores (untracked_gpu_bytes), the prefix's before
    scores = max(rows * heads * (s - prefix) * s, heads * prefix * prefix) * 4
    measured = measured_working(config, policy, b, s, gen, chunk_tokens, prefix=prefix)
    return predicted - _MARGIN + scores, measured


@pytest.mark.parametrize("prefix", [0, 40], ids=["plain", "prefix"])
@pytest.mark.parametrize("chunk_tokens", [64, 256, 1 << 20])
@pytest.mark.parametrize("cache", ["gpu", "cpu_q"])
@pytest.mark.parametrize("model", list(WORKING_MODELS))
def test_working_bytes_bound_the_measured_peak(model, chunk_tokens, cache, prefix, monkeypatch):
    """The formula holds what a block allocates, and is not loose: within 1/0.6 of it (1/0.55 with the cache on
    the host), and it tracks the chunk size (a formula that ignored chunking, or chunks the executor did not
    make, fails one side); with rows sharing 40 of their 64 tokens (computed once) as well; for MoE with the
    expert groups' padded buffers (`expert_buffer_bytes`), grouped as on an accelerator."""
    monkeypatch.setattr(moe, "CPU_GROUP_BYTES", moe.EXPERT_GROUP_BYTES)
    bound, measured = _predicted_and_measured(WORKING_MODELS[model], chunk_tokens, cache, prefix)
    assert measured <= bound
    # with the cache on the host, the store thread's allocations interleave with the block's: the measured peak
    # moves by ~2% from run to run (MoE, chunks of 64: 0.598-0.622 of the bound)
    tight = 0.55 if cache == "cpu_q" else 0.6
    if not (prefix and cache == "cpu_q"):     # there the decode's dequantized-cache term is the larger part, and
        assert measured >= tight * bound      # loose: the block peaks at 0.46-0.55 of it (chunks of 64, 256)


@pytest.mark.parametrize("prefix", [0, 48])
def test_untracked_hidden_with_a_shared_prefix(prefix, tmp_path):
    """Hidden states parked on disk, 3 GPU batches: without a prefix every batch's prefill hidden is parked and
    the measured peak is one batch's working memory; with a 48-token prefix of 64 the prefill's (prefix, rows)
    pairs stay on the device, and `untracked_gpu_bytes` counts the other two batches' pairs: the bound holds
    the peak, and without that term it would not."""
    config = replace(config_from_hf(PRESETS["tiny-llama"]), hidden_size=256, intermediate_size=1024,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512)
    g, k, s, gen, chunk = 8, 6, 64, 3, 64
    policy = Policy(gpu_batch_size=g, num_gpu_batches=k, act_gpu=0.0, act_cpu=0.0)
    work = working_bytes(config, g, s, s + gen - 1, torch.float32, False, 0, chunk, prefix_len=prefix) - _MARGIN
    untracked = untracked_gpu_bytes(config, policy, s, 4, "cpu", shared_prefix_len=prefix)
    measured = measured_working(config, policy, g * k, s, gen, chunk, prefix=prefix, disk_dir=tmp_path)
    assert measured <= work + untracked
    assert measured >= 0.6 * (work + untracked)
    if prefix:
        kept = (k - 1) * (prefix + g * (s - prefix)) * config.hidden_size * 4      # the other batches' pairs
        assert measured > work + untracked - kept


@pytest.mark.parametrize("grouping", ["accelerator", "cpu_default"])
def test_working_bytes_bound_a_sparse_moe(grouping, monkeypatch):
    """Top-2 of 8 experts: the routing pads less than the worst case the formula holds, never more; the CPU's
    one expert per group stays within it too."""
    if grouping == "accelerator":
        monkeypatch.setattr(moe, "CPU_GROUP_BYTES", moe.EXPERT_GROUP_BYTES)
    config = replace(WORKING_MODELS["moe_every_expert"], num_local_experts=8, num_experts_per_tok=2)
    bound, measured = _predicted_and_measured(config, 1 << 20, "gpu")
    assert measured <= bound


def test_opt30b_48x1_fits_16gib_after_chunking():
    """OPT-30B, prompt 512, gen 32, 4-bit weights on the CPU and a 4-bit cache on the GPU (FlexGen's
    placement): chunked, one GPU batch's working memory is 1.46 GiB and 48 x 1 needs 13.73 GiB, where unchunked
    they would be 6.69 GiB and 18.96 GiB."""
    c = config_from_hf(PRESETS["opt-30b"])
    work = working_bytes(c, 48, 512, 543, torch.float16, True)
    assert work < 1.5 * GIB
    shape = dict(w_gpu=0.0, w_cpu=1.0, compress_weights=True, compress_cache=True)
    layout = model_layout(c, 2, True)
    peak = {g: peak_memory(c, layout, Policy(gpu_batch_size=g, num_gpu_batches=1, **shape), 512, 32, 2, "cuda")
            for g in (48, 56)}
    assert peak[48]["gpu"] < 14 * GIB and peak[56]["gpu"] < 16 * GIB
    for g in (48, 96):              # unchunked, 96 x 1 had no feasible placement under 16 GiB at all
        est = search(c, Workload(512, 32, num_prompts=g), Budgets(16 * GIB, 100 * GIB), reference_profile("h200"),
                     compress_weights=True, compress_cache=True, gpu_batch_sizes=(g,), num_gpu_batches=(1,),
                     layout=layout)
        assert (est.policy.gpu_batch_size, est.policy.num_gpu_batches) == (g, 1)
        assert est.peak_memory_bytes["gpu"] <= 16 * GIB


def test_a_chunk_skips_the_pad_columns_all_its_rows_have():
    """Rows sorted by length: a chunk of the short rows starts at the first column any of them has a token in;
    a chunk holding the longest row starts at 0."""
    batch = GpuBatch([0, 1, 2, 3], [[5] * 2, [5] * 3, [5] * 6, [5] * 9], [4] * 4, torch.device("cpu"))
    assert batch.pads_host == [7, 6, 3, 0]
    assert (batch.common_pad(0, 2), batch.common_pad(2, 3), batch.common_pad(0, 4)) == (6, 3, 0)
    batch.compact(torch.tensor([0, 2]))
    assert batch.pads_host == [7, 3] and batch.common_pad(0, 2) == 3


@pytest.mark.parametrize("held_prefix", [False, True])
def test_skipped_cache_positions_are_written_as_zeros(held_prefix):
    """`KVHome.prefill` with skip (at, n): keys from index `at` on land n positions further, and the n skipped
    positions hold zeros, never the home's old bytes (NaN here), which a masked product would spread."""
    budget = MemoryBudget({Tier.GPU: None, Tier.CPU: None, Tier.DISK: None})
    L = 2 if held_prefix else 0
    home = KVHome(Arena(torch.device("cpu"), budget, None), "kv", rows=2, length=12, num_kv_heads=2, head_dim=4,
                  dtype=torch.float32, cache_gpu=1.0, cache_cpu=0.0, quant=None, cpu_attention=False, prefix_len=L)
    seg = home.segments[0]
    seg.k.fill_(float("nan"))
    seg.v.fill_(float("nan"))
    k, v = torch.randn(2, 2, 7, 4), torch.randn(2, 2, 7, 4)            # 2 prefix keys, then 5 own ones
    q, mask = torch.randn(2, 2, 5, 4), torch.ones(2, 1, 5, 7, dtype=torch.bool)
    home.prefill(q, k, v, mask, 0.5, row0=0, skip=(2, 3))
    own = 0 if held_prefix else 2                                       # home position of the first own key
    assert torch.equal(seg.k[:, :, own + 3:own + 8], k[:, :, 2:])
    assert torch.equal(seg.v[:, :, own:own + 3], torch.zeros(2, 2, 3, 4))
    assert torch.equal(seg.k[:, :, own:own + 3], torch.zeros(2, 2, 3, 4))
    if not held_prefix:
        assert torch.equal(seg.k[:, :, :2], k[:, :, :2])
    assert home.written == own + 8
