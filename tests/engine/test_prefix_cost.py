"""A shared prompt prefix in the cost and memory models: computed once per GPU batch and its keys/values held
once, as the executor does; without one (or below the executor's minimum, or one row per batch) nothing changes."""
from dataclasses import replace

import pytest
import torch

from engine.models.hf_config import config_from_hf
from engine.models.presets import PRESETS
from engine.policy import model_stats as ms
from engine.policy.affine import VARS
from engine.policy.cost_model import Workload, _expected_expert_bytes, cost_terms, estimate
from engine.policy.hardware import GIB, reference_profile
from engine.policy.memory import _kv_bytes, _stage_bytes, executor_memory, model_layout
from engine.policy.policy import Policy
from engine.policy.prefix import MIN_SHARED_PREFIX, batch_prefix_len

# the reference profile without its measured per-slot host costs: the numbers pinned below were computed so
H200 = replace(reference_profile("h200"), slot_prefill_ms=0.0, slot_decode_ms=0.0, slot_gpu_cache_q4_ms=0.0,
               slot_off_cache_ms=0.0, slot_off_cache_q4_ms=0.0, slot_off_weights_ms=0.0,
               layer_q4_weights_ms=0.0, cpu_attention_gib_s=0.0, cpu_attention_q4_gib_s=0.0,  # nor host attention's
               moe_cpu_attention_slot_ms=0.0, weight_page_ms=0.0)
WRANGLE = Workload(200, 10, num_prompts=1536)                   # issue 16: 150 shared + 50 own tokens
# the auto policy for llama-3-70b at 16 GiB before the planner knew of prefixes
LLAMA_96X16 = Policy(gpu_batch_size=96, num_gpu_batches=16, w_gpu=0.2779, w_cpu=0.7221, cache_gpu=0.0,
                     cache_cpu=1.0, act_gpu=0.0, act_cpu=1.0, compress_weights=True, compress_cache=True)
MIXTRAL_64X4 = Policy(gpu_batch_size=64, num_gpu_batches=4, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.0, cache_cpu=1.0,
                      cpu_attention=True, compress_weights=True, compress_cache=True)


def preset(name):
    return config_from_hf(PRESETS[name])


@pytest.mark.parametrize("name, policy, prefill_s, decode_s, peak", [
    ("llama-3-70b", LLAMA_96X16, 62.22810316112912, 10.988038059338521,      # gpu: + the GQA fold's q copy
     {"gpu": 8533608192, "cpu": 73168453632, "disk": 0}),                     # and masks (was 8186912768)
    ("mixtral-8x7b", MIXTRAL_64X4, 1.9900291050823231, 6.336870902529642,      # gpu: the grouped experts'
     {"gpu": 5257848672, "cpu": 28131852288, "disk": 0}),                     # working memory, the fold, the pairs
])
def test_no_prefix_predicts_what_it_did_before(name, policy, prefill_s, decode_s, peak):
    """Prefix 0, a prefix under the executor's minimum, or one row per GPU batch: the numbers of the cost
    model before prefixes (commit c2983ff), exactly; the gpu peaks with the grouped-query fold of a prefill
    chunk's attention (`working.working_bytes`) and Mixtral's with the MoE layer's working memory of the
    grouped experts (`working.moe_mlp_bytes`, 750 MiB less than the old per-token term); decode and the cpu
    peak with the embedding and the head held on the gpu (`weight_slots.held_whole`: the gpu peak is the
    same, their buffers were as large; llama's decode was 12.722 s, its cpu peak 81,647,566,848); llama's
    decode and gpu peak with a decode step's hidden states on the gpu (`engine.runtime.act_homes`: no hidden
    crosses the link in decode, 12.037 s before; the other 15 GPU batches' [96, 1, 8192] held, +23,592,960);
    mixtral's decode with the executor's slot time in series with its pipelined host attention (stop 40: they
    share the host's cores; 5.705 s before, when the slots were a channel of their own); llama's cpu peak with
    the decode stores' own staging ring (`memory.decode_stage_slots`: 16 sets of [96, 8, 1, 128] 4-bit keys and
    values, +1,769,472; it was 77,444,874,240 when they shared the prefill's two); llama's decode with a cache
    load moving each row's written positions, 204 on average over the 9 decode steps, where the mean context
    is 205 (`KVHome.load`; 11.709 s when it was the mean context, 11.801 s when a load copied the whole home);
    mixtral's gpu peak with the routed pairs' outputs before their sum (`experts_grouped_mm`: 4,000 tokens of
    [2, 4096] bfloat16, +65,536,000; it was 5,282,940,768) and a second buffer for the expert layers' dense
    tensors (loaded a layer of their kind ahead, `weight_slots.streamed_ahead`: the norm and the router,
    +73,728; it was 5,348,476,768); decode and both peaks with the weights compressed in groups of 64
    (`engine.models.weights.weight_quant`: 4.5 bits a weight, not 5): llama's decode was 11.686 s and its
    peaks 8,587,085,568 / 77,446,643,712, mixtral's decode 6.396 s and its peaks 5,348,550,496 /
    31,034,310,656."""
    c = preset(name)
    for workload, pol in ((WRANGLE, policy), (replace(WRANGLE, shared_prefix_len=MIN_SHARED_PREFIX - 1), policy)):
        est = estimate(c, pol, workload, H200)
        assert (est.prefill_s, est.decode_s, est.peak_memory_bytes) == (prefill_s, decode_s, peak)
    one_row = replace(policy, gpu_batch_size=1)
    assert estimate(c, one_row, replace(WRANGLE, shared_prefix_len=150), H200) == estimate(c, one_row, WRANGLE, H200)


@pytest.mark.parametrize("name, policy", [("llama-3-70b", LLAMA_96X16), ("mixtral-8x7b", MIXTRAL_64X4)])
def test_prefill_falls_with_the_prefix(name, policy):
    """Prefill: fewer tokens computed (and stored). Decode: over a host cache attended on the GPU (llama) the
    cache loads shrink with the prefix (held once on the device); with CPU attention (mixtral) the host
    still reads the mean context, so decode does not move."""
    c = preset(name)
    runs = [estimate(c, policy, replace(WRANGLE, shared_prefix_len=p), H200) for p in (0, 50, 100, 150)]
    prefill = [e.prefill_s for e in runs]
    assert prefill == sorted(prefill, reverse=True) and len(set(prefill)) == 4
    decode = [e.decode_s for e in runs]
    if policy.cpu_attention:
        assert set(decode) == {decode[0]}
    else:
        assert decode == sorted(decode, reverse=True) and len(set(decode)) == 4
    # compute-bound prefill: the tokens computed fall from 1536 x 200 to 16 x 150 + 1536 x 50 (llama)
    if name == "llama-3-70b":
        tokens = (16 * 150 + 1536 * 50) / (1536 * 200)
        assert runs[-1].prefill_s / runs[0].prefill_s == pytest.approx(tokens, rel=0.02)


def test_the_cache_holds_each_rows_own_positions():
    """The prefix's keys/values are held once per GPU batch: the prefill's cache stores carry the rows' own
    50 of 200 positions, the decode's cache loads the own 54 of the 204 positions written on average; the cache homes and their
    staging shrink to the own positions, the device gains the dense prefix k/v; the prefill's hidden states
    are not parked with a prefix (the (prefix, rows) pair stays on the device)."""
    c = preset("llama-3-70b")
    plain, shared = (cost_terms(c, LLAMA_96X16, replace(WRANGLE, shared_prefix_len=p), H200, 2) for p in (0, 150))
    cache_gpu, act_gpu = VARS.index("cache_gpu"), VARS.index("act_gpu")
    for channel in ("gpu->cpu", "cpu->disk"):
        assert shared.prefill[channel][cache_gpu] == pytest.approx(plain.prefill[channel][cache_gpu] * 50 / 200)
    assert shared.decode["cpu->gpu"][cache_gpu] == pytest.approx(plain.decode["cpu->gpu"][cache_gpu] * 54 / 204)
    for channel in ("gpu->cpu", "cpu->gpu"):
        assert plain.prefill[channel][act_gpu] != 0 and shared.prefill[channel][act_gpu] == 0
    layout = model_layout(c, 2, True)
    cache_only = replace(LLAMA_96X16, act_gpu=1.0, act_cpu=0.0)
    m0, m1 = (executor_memory(c, layout, cache_only, 200, 10, 2, "cuda", shared_prefix_len=p) for p in (0, 150))
    g, k, layers, nkv, hd = 96, 16, c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    homes = layers * k * 2 * (_kv_bytes(g, nkv, 209, hd, torch.float16, True)
                              - _kv_bytes(g, nkv, 59, hd, torch.float16, True))
    stages = 2 * (_stage_bytes(g, nkv, 200, hd, torch.float16, True)
                  - _stage_bytes(g, nkv, 200, hd, torch.float16, True, 150))
    assert m0["cpu"] - m1["cpu"] == homes + stages
    prefix_kv = layers * k * 2 * nkv * 150 * hd * 2
    assert m1["gpu"] - prefix_kv < m0["gpu"]                       # one GPU batch's working memory shrinks


def test_prefill_hidden_with_a_prefix_is_never_parked():
    """Hidden states on the cpu: with a prefix nothing is parked (no homes: a decode step's [g, 1, h] stays on
    the gpu too), and the other GPU batches' prefill pairs count on the gpu."""
    c = preset("llama-3-70b")
    layout = model_layout(c, 2, True)
    cache_on_gpu = replace(LLAMA_96X16, cache_gpu=1.0, cache_cpu=0.0)
    m0, m1 = (executor_memory(c, layout, cache_on_gpu, 200, 10, 2, "cuda", shared_prefix_len=p) for p in (0, 150))
    h, g, k = c.hidden_size, 96, 16
    assert m0["cpu"] - m1["cpu"] == k * g * 200 * h * 2
    m0, m1 = (executor_memory(c, layout, LLAMA_96X16, 200, 10, 2, "cuda", shared_prefix_len=p) for p in (0, 150))
    e0, e1 = (estimate(c, LLAMA_96X16, replace(WRANGLE, shared_prefix_len=p), H200) for p in (0, 150))
    kept = (k - 1) * (150 + g * 50) * h * 2
    assert e1.peak_memory_bytes["gpu"] - m1["gpu"] == kept
    ahead = g * 200 * h * 2                                         # act_gpu 0 without a prefix, K = 16: the next
    assert e0.peak_memory_bytes["gpu"] - m0["gpu"] == ahead         # batch's prefill hidden loaded ahead is untracked


def test_moe_experts_see_the_prefix_once():
    """Mixtral, a memory-bound prefill (2 rows of 6 tokens, 4 shared): per GPU batch the experts' weights are
    read for the prefix's 4 tokens once and for the rows' 2 x 2 own tokens, not for 2 x 6 tokens."""
    c = preset("mixtral-8x7b")
    policy = Policy(gpu_batch_size=2, num_gpu_batches=1)
    prefixed = cost_terms(c, policy, Workload(6, 2, shared_prefix_len=4), H200, 2).prefill["gpu compute"][6]
    per_expert = ms.expert_numel(c) * 2
    dense = (ms.layer_dense_bytes(c, 2) + ms.edge_weight_bytes(c, 2) / c.num_hidden_layers
             - c.num_local_experts * per_expert)
    bw = H200.gpu_mem_gib_s * GIB
    reads = (2 * dense + 2 * _expected_expert_bytes(c, 4, per_expert)) / bw
    assert prefixed == pytest.approx(reads, rel=0.01)                # attention and the rest: under 1%
    plain = cost_terms(c, policy, Workload(6, 2), H200, 2).prefill["gpu compute"][6]
    assert plain == pytest.approx((dense + _expected_expert_bytes(c, 12, per_expert)) / bw, rel=0.01)


def test_batch_prefix_len_is_the_executors_rule():
    assert batch_prefix_len(150, 96) == 150
    assert batch_prefix_len(150, 1) == 0                            # one row: nothing to share
    assert batch_prefix_len(MIN_SHARED_PREFIX - 1, 96) == 0
    assert batch_prefix_len(MIN_SHARED_PREFIX, 2) == MIN_SHARED_PREFIX


@pytest.mark.parametrize("prefix", [-1, 200, 201])
def test_workload_rejects_a_prefix_outside_the_prompt(prefix):
    with pytest.raises(ValueError, match=r"Workload\.shared_prefix_len .* got " + str(prefix)):
        Workload(200, 10, shared_prefix_len=prefix)
