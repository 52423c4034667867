"""The cost model's MoE terms: CGOPipe overlap of host attention with GPU experts, weight pages, and the
search's choice for Mixtral-8x7B at 16 GiB on the H200 profile; the memory model counts the pipeline's
staging exactly (pure arithmetic)."""
from dataclasses import replace

import pytest

from engine.models.hf_config import config_from_hf
from engine.models.presets import PRESETS
from engine.policy.cost_model import PAGE_BYTES, Workload, estimate, weight_pages
from engine.policy.estimate import Budgets
from engine.policy.hardware import GIB, Q4_ATTENTION_RATIO, reference_profile
from engine.policy.memory import executor_memory
from engine.policy.policy import Policy
from engine.policy.search import search
from engine.runtime.layout import model_layout

H200 = reference_profile("h200")
MOE_WORKLOAD = Workload(prompt_len=77, gen_len=128, num_prompts=512)   # the Mixtral-8x7B benchmark shape
MIXTRAL = config_from_hf(PRESETS["mixtral-8x7b"])
LAYOUT = model_layout(MIXTRAL)
HOST_CACHE = dict(w_gpu=0.0, w_cpu=1.0, cache_gpu=0.0, cache_cpu=1.0, cpu_attention=True, compress_weights=True,
                  compress_cache=True)


def _mixtral_auto(q4_share: float, **host):
    """The search's Mixtral-8x7B plan at 16 GiB on the H200 profile whose host 4-bit attention reads at
    `q4_share` of its dense rate (the reference profile leaves it unmeasured) and whose other fields are
    replaced by `host`, and that profile."""
    profile = replace(H200, cpu_attention_q4_gib_s=H200.cpu_attention_bytes_s / GIB * q4_share, **host)
    return search(MIXTRAL, MOE_WORKLOAD, Budgets(16 * GIB, 88 * GIB), profile, compress_weights=True,
                  compress_cache=True, cpu_attention=None, model_name="mixtral-8x7b", layout=LAYOUT), profile


# an executor whose host work is free (not the H200's, see below): what is left is the channels' overlap
FAST_HOST = {name: 1e-4 for name in ("moe_cpu_attention_slot_ms", "weight_page_ms", "slot_decode_ms",
                                     "slot_off_weights_ms", "slot_gpu_cache_q4_ms", "slot_off_cache_q4_ms",
                                     "layer_q4_weights_ms")}


def test_auto_picks_pipelined_cpu_attention_for_mixtral_when_the_host_is_fast():
    """With host 4-bit attention at 1/4 of dense (twice the reference profile's share) and a cheap executor the
    plan is MoE-Lightning's."""
    best, profile = _mixtral_auto(1 / 4, **FAST_HOST)
    p = best.policy
    assert p.cpu_attention and p.pipeline and p.cache_gpu < 1.0 and p.compress_cache
    assert p.block_size == MOE_WORKLOAD.num_prompts   # every row in one block, most of its cache on the host
    assert p.weight_pages == weight_pages(MIXTRAL, model_layout(MIXTRAL, 2, True), p.num_gpu_batches, True)
    ablation = estimate(MIXTRAL, replace(p, pipeline=False), MOE_WORKLOAD, profile, layout=LAYOUT)
    assert best.predicted_tokens_per_s > 1.2 * ablation.tokens_per_s


def test_the_h200_executor_costs_keep_mixtral_attention_on_the_gpu():
    """The same fast host attention under the H200's measured executor costs (the compute thread's slots and 27
    weight pages per layer take 0.81 s of a 1.38 s step): the plan attends on the GPU."""
    best, _ = _mixtral_auto(1 / 4)
    assert not best.policy.cpu_attention


def test_reference_profile_predicts_the_measured_cgopipe_policies():
    """Two measured Mixtral-8x7B runs on an H200 (bf16, 16-bit host cache, pipelined host attention): 256 x 4
    over 1,024 rows at 719 tok/s (1.38 s a step) and 256 x 8 over 2,048 rows at a median 1.96 s a step. The
    reference profile predicts both within 1.25x."""
    work = Workload(prompt_len=77, gen_len=128, num_prompts=1024)
    base = dict(act_gpu=0.0, act_cpu=1.0, cpu_attention=True, compress_weights=True, compress_cache=False,
                weight_pages=27)
    four = Policy(gpu_batch_size=256, num_gpu_batches=4, w_gpu=0.5, w_cpu=0.5, cache_gpu=0.0, cache_cpu=1.0, **base)
    eight = Policy(gpu_batch_size=256, num_gpu_batches=8, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.125, cache_cpu=0.875,
                   **base)
    measured_tok_s = 719.2
    predicted = estimate(MIXTRAL, four, work, H200, layout=LAYOUT).tokens_per_s
    assert measured_tok_s <= predicted <= 1.25 * measured_tok_s
    step = estimate(MIXTRAL, eight, replace(work, num_prompts=2048), H200, layout=LAYOUT).decode_s / 127
    assert 1.96 / 1.25 <= step <= 1.96 * 1.25
    with_page = estimate(MIXTRAL, four, work, replace(H200, weight_page_ms=2 * H200.weight_page_ms), layout=LAYOUT)
    assert with_page.decode_s > estimate(MIXTRAL, four, work, H200, layout=LAYOUT).decode_s   # pages cost the executor


def test_slow_host_4bit_attention_moves_mixtral_attention_to_the_gpu():
    """At the dev CPU's measured share (`Q4_ATTENTION_RATIO`, 1/8, the default of the reference profile) host
    attention over the 4-bit cache does not pay: the plan attends on the GPU."""
    best, _ = _mixtral_auto(Q4_ATTENTION_RATIO)
    default = search(MIXTRAL, MOE_WORKLOAD, Budgets(16 * GIB, 88 * GIB), H200, compress_weights=True,
                     compress_cache=True, cpu_attention=None, model_name="mixtral-8x7b", layout=LAYOUT)
    assert not best.policy.cpu_attention and default.policy == best.policy


def test_pipeline_overlaps_host_attention_with_gpu_work():
    """With a free executor a layer costs about max(G, A) + min(G, A) / k pipelined, G + A without; more GPU
    batches, less bubble (on the H200 each slot's host cost outweighs that: see the test below; weights
    resident, so neither is hidden behind the weight transfer and no page is issued; memory is not checked
    here)."""
    times = {}
    for k in (1, 2, 4):
        policy = Policy(gpu_batch_size=512 // k, num_gpu_batches=k, weight_pages=32,
                        **{**HOST_CACHE, "w_gpu": 1.0, "w_cpu": 0.0})
        on = estimate(MIXTRAL, policy, MOE_WORKLOAD, replace(H200, **FAST_HOST), layout=LAYOUT)
        off = estimate(MIXTRAL, replace(policy, pipeline=False), MOE_WORKLOAD, replace(H200, **FAST_HOST), layout=LAYOUT)
        assert on.decode_s < off.decode_s if k > 1 else on.decode_s == off.decode_s   # one batch: no overlap
        times[k] = on.decode_s
    assert times[4] < times[2] < times[1]


def test_more_pages_shorten_the_wait_behind_weights_but_cost_the_executor():
    """With a cheap executor, 32 pages beat one (the attention outputs wait behind less of a layer); at the H200's
    measured cost per page (0.42 ms) 32 pages cost more host time than the wait they save."""
    policy = Policy(gpu_batch_size=128, num_gpu_batches=4, **{**HOST_CACHE, "w_gpu": 0.5, "w_cpu": 0.5})
    fast = replace(H200, **FAST_HOST)
    few = estimate(MIXTRAL, replace(policy, weight_pages=1), MOE_WORKLOAD, fast, layout=LAYOUT)
    many = estimate(MIXTRAL, replace(policy, weight_pages=32), MOE_WORKLOAD, fast, layout=LAYOUT)
    assert many.decode_s < few.decode_s
    few = estimate(MIXTRAL, replace(policy, weight_pages=1), MOE_WORKLOAD, H200, layout=LAYOUT)
    many = estimate(MIXTRAL, replace(policy, weight_pages=32), MOE_WORKLOAD, H200, layout=LAYOUT)
    assert many.decode_s > few.decode_s


def test_weight_pages_rule():
    layout = model_layout(MIXTRAL, 2, True)
    largest = max(sum(k.stored) for k in layout.kinds)
    pages = weight_pages(MIXTRAL, layout, 2, True)
    assert largest / pages <= PAGE_BYTES < largest / (pages - 1)
    assert weight_pages(MIXTRAL, layout, 64, True) == 64
    assert weight_pages(MIXTRAL, layout, 4, False) == 0       # GPU attention: one page per GPU batch
    dense = config_from_hf(PRESETS["llama-3-8b"])
    assert weight_pages(dense, model_layout(dense, 2, False), 4, True) == 0


@pytest.mark.parametrize("split", [(0.0, 1.0), (0.5, 0.5), (0.25, 0.5)])
def test_memory_model_counts_host_attention_staging(split):
    """On CUDA the pipeline stages one GPU batch's q/k/v/out per host cache segment: K sets, counted the same
    by the executor's accounting (`executor_memory`) and the LP's affine terms (`estimate`)."""
    c = MIXTRAL
    policy = Policy(gpu_batch_size=64, num_gpu_batches=3, **{**HOST_CACHE, "cache_gpu": split[0],
                                                              "cache_cpu": split[1]})
    layout = model_layout(c, 2, True)
    w = MOE_WORKLOAD
    on = executor_memory(c, layout, policy, w.prompt_len, w.gen_len, 2, "cuda")
    off = executor_memory(c, layout, replace(policy, pipeline=False), w.prompt_len, w.gen_len, 2, "cuda")
    group = c.num_attention_heads // c.num_key_value_heads
    host_heads = c.num_key_value_heads - round(split[0] * c.num_key_value_heads)
    stage = 3 * 64 * c.head_dim * 2 * (2 * group * host_heads + 2 * host_heads)
    assert on["cpu"] - off["cpu"] == stage and on["gpu"] == off["gpu"]
    assert estimate(c, policy, w, H200, layout=model_layout(c)).peak_memory_bytes["cpu"] == on["cpu"]
    cpu_only = executor_memory(c, layout, policy, w.prompt_len, w.gen_len, 2, "cpu")
    assert cpu_only == executor_memory(c, layout, replace(policy, pipeline=False), w.prompt_len, w.gen_len, 2,
                                       "cpu")


def test_search_pages_coarsely_where_pages_cost_the_executor():
    """Host attention forced: on the H200's measured executor costs one page per GPU batch prices faster than
    the finest paging (27 pages of 0.42 ms each a layer); with a free executor the finest paging wins
    (the test above)."""
    best = search(MIXTRAL, MOE_WORKLOAD, Budgets(16 * GIB, 88 * GIB), H200, compress_weights=True,
                  compress_cache=False, cpu_attention=True, model_name="mixtral-8x7b", layout=LAYOUT)
    p = best.policy
    assert p.cpu_attention and 1 < p.num_gpu_batches == p.weight_pages
    fine = estimate(MIXTRAL, replace(p, weight_pages=weight_pages(MIXTRAL, model_layout(MIXTRAL, 2, True),
                                                                  p.num_gpu_batches, True)), MOE_WORKLOAD, H200,
                    layout=LAYOUT)
    assert best.predicted_tokens_per_s > fine.tokens_per_s


def test_search_fills_the_device_memory_weights_left_with_cache():
    """Mixtral-8x7B over 4,096 rows at 16 GiB, 4096x1 with every weight streamed (weights rounded down to a
    tensor boundary leave 6 of 16 GiB empty): `search._fill_cache` moves kv heads of the cache to the gpu while
    they fit and are faster, so fewer bytes cross the link each step."""
    from engine.policy.cost_model import cost_terms
    from engine.policy.search import _Candidate, _fill_cache

    workload = replace(MOE_WORKLOAD, num_prompts=4096)
    limits = {"gpu": 16 * GIB, "cpu": 88 * GIB, "disk": 0}
    streamed = Policy(gpu_batch_size=4096, num_gpu_batches=1, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.0, cache_cpu=1.0,
                      act_gpu=1.0, act_cpu=0.0, compress_weights=True, compress_cache=True)
    layout = model_layout(MIXTRAL, 2, True)
    terms = cost_terms(MIXTRAL, streamed, workload, H200, 2, layout)
    before = estimate(MIXTRAL, streamed, workload, H200, layout=layout, terms=terms)
    assert before.peak_memory_bytes["gpu"] < limits["gpu"] - 4 * GIB
    found = _fill_cache(MIXTRAL, layout, _Candidate(before.tokens_per_s, streamed, before), terms, workload, H200,
                        2, limits)
    p, step = found.policy, 1 / MIXTRAL.num_key_value_heads
    assert p.cache_gpu > 0 and p.cache_gpu + p.cache_cpu == 1.0
    assert found.estimate.peak_memory_bytes["gpu"] <= limits["gpu"] and found.tokens_per_s > before.tokens_per_s
    more = replace(p, cache_gpu=p.cache_gpu + step, cache_cpu=p.cache_cpu - step)   # one more head: too much
    assert estimate(MIXTRAL, more, workload, H200, layout=LAYOUT).peak_memory_bytes["gpu"] > limits["gpu"]
