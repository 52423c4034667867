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
from engine.policy.dtypes import stored_nbytes
from engine.policy.hardware import GIB, reference_profile
from engine.policy.memory import executor_memory
from engine.policy.policy import Policy
from engine.policy.prefix import MIN_SHARED_PREFIX, batch_prefix_len
from engine.policy.working import row_chunks
from engine.quant.config import CACHE_QUANT
from engine.runtime.layout import model_layout

# the reference profile without its measured per-slot host costs: the numbers pinned below were computed so
H200 = replace(reference_profile("h200"), slot_prefill_ms=0.0, slot_decode_ms=0.0, slot_gpu_cache_q4_ms=0.0,
               slot_off_cache_ms=0.0, slot_off_cache_q4_ms=0.0, slot_off_weights_ms=0.0,
               layer_q4_weights_ms=0.0, cpu_attention_gib_s=0.0, cpu_attention_q4_gib_s=0.0,  # nor host attention's
               moe_cpu_attention_slot_ms=0.0, weight_page_ms=0.0)
WRANGLE = Workload(200, 10, num_prompts=1536)                   # the wrangle shape: 150 shared + 50 own tokens
# the planner's policy for llama-3-70b at 16 GiB when the prompts share no prefix
LLAMA_96X16 = Policy(gpu_batch_size=96, num_gpu_batches=16, w_gpu=0.2779, w_cpu=0.7221, cache_gpu=0.0,
                     cache_cpu=1.0, act_gpu=0.0, act_cpu=1.0, compress_weights=True, compress_cache=True)
MIXTRAL_64X4 = Policy(gpu_batch_size=64, num_gpu_batches=4, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.0, cache_cpu=1.0,
                      cpu_attention=True, compress_weights=True, compress_cache=True)


def preset(name):
    return config_from_hf(PRESETS[name])


def kv_bytes(rows: int, heads: int, length: int, head_dim: int) -> int:
    """Bytes of one 4-bit float16 keys (or values) tensor [rows, heads, length, head_dim]."""
    return stored_nbytes((rows, heads, length, head_dim), "float16", CACHE_QUANT)


def stage_bytes(rows: int, heads: int, prompt_len: int, head_dim: int, prefix: int = 0) -> int:
    """Bytes of one set of a prefill's 4-bit store staging (keys + values per row chunk of the rows' own
    tokens, each holding their own prompt positions: a prefix held once)."""
    return sum(2 * kv_bytes(r1 - r0, heads, prompt_len - prefix, head_dim)
               for r0, r1 in row_chunks(rows, prompt_len - prefix))


@pytest.mark.parametrize("name, policy, prefill_s, decode_s, peak", [
    ("llama-3-70b", LLAMA_96X16, 64.488862763966, 10.988038059338521,      # gpu: with the GQA fold's q
     {"gpu": 8533608192, "cpu": 73168453632, "disk": 0}),                     # copy and masks
    ("mixtral-8x7b", MIXTRAL_64X4, 2.1185354404014722, 6.338316598801984,      # gpu: the grouped experts'
     {"gpu": 5257848672, "cpu": 28131852288, "disk": 0}),                     # working memory, the fold, the pairs
])
def test_no_usable_prefix_predicts_the_pinned_numbers(name, policy, prefill_s, decode_s, peak):
    """Prefix 0, a prefix under the executor's minimum, or one row per GPU batch: the same numbers, pinned
    exactly. They count the grouped-query fold of a prefill chunk's attention in the gpu peaks
    (`working.working_bytes`); Mixtral's MoE working memory of the grouped experts (`working.moe_mlp_bytes`)
    and its routed pairs' outputs before their sum (`experts_grouped_mm`: 4,000 tokens of [2, 4096] bfloat16);
    the embedding and the head held on the gpu (`weight_slots.held_whole`); a decode step's hidden states on
    the gpu (`engine.runtime.act_homes`: no hidden crosses the link in decode; llama's other 15 GPU batches'
    [96, 1, 8192] held); Mixtral's executor slot time in series with its pipelined host attention (they share
    the host's cores); the decode stores' own staging ring (`buffers.decode_stage_slots`: for llama 16 sets of
    [96, 8, 1, 128] 4-bit keys and values); a cache load moving each row's written positions (`KVHome.load`:
    204 on average over llama's 9 decode steps, where the mean context is 205); a second buffer for the expert
    layers' dense tensors (`weight_slots.streamed_ahead`: the norm and the router); weights compressed in
    groups of 64 (`engine.models.weights.weight_quant`: 4.5 bits a weight); and the elementwise passes over
    every token's activations (`model_stats.activation_bytes_per_token`)."""
    c = preset(name)
    layout = model_layout(c)
    for workload, pol in ((WRANGLE, policy), (replace(WRANGLE, shared_prefix_len=MIN_SHARED_PREFIX - 1), policy)):
        est = estimate(c, pol, workload, H200, layout=layout)
        assert (est.prefill_s, est.decode_s, est.peak_memory_bytes) == (prefill_s, decode_s, peak)
    one_row = replace(policy, gpu_batch_size=1)
    assert (estimate(c, one_row, replace(WRANGLE, shared_prefix_len=150), H200, layout=layout)
            == estimate(c, one_row, WRANGLE, H200, layout=layout))


@pytest.mark.parametrize("name, policy", [("llama-3-70b", LLAMA_96X16), ("mixtral-8x7b", MIXTRAL_64X4)])
def test_prefill_falls_with_the_prefix(name, policy):
    """Prefill: fewer tokens computed (and stored). Decode: over a host cache attended on the GPU (llama) the
    cache loads shrink with the prefix (held once on the device); with CPU attention (mixtral) the host
    still reads the mean context, so decode does not move."""
    c = preset(name)
    runs = [estimate(c, policy, replace(WRANGLE, shared_prefix_len=p), H200,
                     layout=model_layout(c)) for p in (0, 50, 100, 150)]
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
    plain, shared = (cost_terms(c, LLAMA_96X16, replace(WRANGLE, shared_prefix_len=p), H200, 2,
                                layout=model_layout(c)) for p in (0, 150))
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
    homes = layers * k * 2 * (kv_bytes(g, nkv, 209, hd) - kv_bytes(g, nkv, 59, hd))
    stages = 2 * (stage_bytes(g, nkv, 200, hd) - stage_bytes(g, nkv, 200, hd, 150))
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
    e0, e1 = (estimate(c, LLAMA_96X16, replace(WRANGLE, shared_prefix_len=p), H200,
                       layout=model_layout(c)) for p in (0, 150))
    kept = (k - 1) * (150 + g * 50) * h * 2
    assert e1.peak_memory_bytes["gpu"] - m1["gpu"] == kept
    ahead = g * 200 * h * 2                                         # act_gpu 0 without a prefix, K = 16: the next
    assert e0.peak_memory_bytes["gpu"] - m0["gpu"] == ahead         # batch's prefill hidden loaded ahead is untracked


def test_moe_experts_see_the_prefix_once():
    """Mixtral, a memory-bound prefill (2 rows of 6 tokens, 4 shared): per GPU batch the experts' weights are
    read for the prefix's 4 tokens once and for the rows' 2 x 2 own tokens, not for 2 x 6 tokens."""
    c = preset("mixtral-8x7b")
    policy = Policy(gpu_batch_size=2, num_gpu_batches=1)
    prefixed = cost_terms(c, policy, Workload(6, 2, shared_prefix_len=4), H200, 2,
                          layout=model_layout(c)).prefill["gpu compute"][6]
    per_expert = ms.expert_numel(c) * 2
    dense = (ms.layer_dense_bytes(c, 2) + ms.edge_weight_bytes(c, 2) / c.num_hidden_layers
             - c.num_local_experts * per_expert)
    bw = H200.gpu_mem_gib_s * GIB
    reads = (2 * dense + 2 * _expected_expert_bytes(c, 4, per_expert)) / bw
    assert prefixed == pytest.approx(reads, rel=0.01)                # attention and the rest: under 1%
    plain = cost_terms(c, policy, Workload(6, 2), H200, 2, layout=model_layout(c)).prefill["gpu compute"][6]
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
