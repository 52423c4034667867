"""Model statistics and the analytical cost model: sizes, compression, KV growth, CPU attention, memory."""
from dataclasses import replace

import pytest

from engine.models.hf_config import config_from_hf
from engine.models.presets import PRESETS
from engine.policy import model_stats as ms
from engine.policy.affine import placement_vector
from engine.policy.cost_model import Workload, cost_terms, decode_slack, estimate
from engine.policy.hardware import GIB, reference_profile
from engine.policy.policy import Policy
from engine.runtime.layout import model_layout

H200 = reference_profile("h200")
WORKLOAD = Workload(prompt_len=512, gen_len=32)


def preset(name):
    return config_from_hf(PRESETS[name])


@pytest.mark.parametrize("name, params", [
    ("opt-6.7b", 6.66e9), ("opt-30b", 29.97e9), ("opt-175b", 174.6e9), ("llama-3-8b", 8.03e9),
    ("llama-3-70b", 70.55e9), ("mixtral-8x7b", 46.70e9),
])
def test_total_parameters_match_published_sizes(name, params):
    assert ms.total_numel(preset(name)) == pytest.approx(params, rel=0.01)


def test_moe_activated_flops_count_top_k_experts():
    c = preset("mixtral-8x7b")
    active = ms.active_matmul_numel(c) * c.num_hidden_layers
    assert active == pytest.approx(12.6e9, rel=0.02)        # ~12.9B activated incl. embeddings
    assert ms.matmul_flops_per_token(c) < ms.dense_flops_per_token(c) / 3


def test_kv_bytes_and_operational_intensity():
    c = preset("llama-3-8b")
    assert ms.kv_bytes_per_token(c, 2) == 2 * 8 * 128 * 2
    assert ms.attention_operational_intensity(c, 2) == pytest.approx(4.0)   # GQA 32 q heads / 8 kv heads
    assert ms.attention_operational_intensity(preset("opt-30b"), 2) == pytest.approx(1.0)


def test_compression_is_028_of_fp16():
    assert ms.compressed_bytes(64 * 1000) / (64 * 1000 * 2) == pytest.approx(0.28125)
    c = preset("opt-30b")
    ratio = ms.layer_weight_bytes(c, 2, compress=True) / ms.layer_weight_bytes(c, 2)
    assert 0.28 <= ratio < 0.29


def test_compressed_weights_move_fewer_bytes():
    c = preset("opt-30b")
    base = Policy(gpu_batch_size=32, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.0, cache_cpu=1.0, cpu_attention=True)
    plain = cost_terms(c, base, WORKLOAD, H200, 2, layout=model_layout(c))
    packed = cost_terms(c, replace(base, compress_weights=True), WORKLOAD, H200, 2, layout=model_layout(c))
    x = placement_vector(base)
    ratio = (packed.decode["cpu->gpu"][:6] @ x + packed.decode["cpu->gpu"][6]) / (
        plain.decode["cpu->gpu"][:6] @ x + plain.decode["cpu->gpu"][6])
    # groups of 64 with float16 min/scale: 4 + 32/64 = 4.5 bits of 16 (0.28125), plus the dense output head
    assert ratio == pytest.approx(0.30, abs=0.01)
    # dequantization is paid in compute
    assert packed.decode["compute"][6] > plain.decode["compute"][6]


def test_kv_cache_growth_raises_decode_traffic():
    c = preset("opt-6.7b")
    p = Policy(gpu_batch_size=64, w_gpu=1.0, cache_gpu=0.0, cache_cpu=1.0)
    short = estimate(c, p, Workload(prompt_len=128, gen_len=32), H200, layout=model_layout(c))
    long = estimate(c, p, Workload(prompt_len=128, gen_len=512), H200, layout=model_layout(c))
    per_step_short = short.decode_s / 31
    per_step_long = long.decode_s / 511
    assert per_step_long > per_step_short * 2          # mean context 128 + 256 against 128 + 16
    assert long.peak_memory_bytes["cpu"] > short.peak_memory_bytes["cpu"]


def test_cpu_attention_avoids_moving_the_cache():
    c = preset("opt-30b")
    p = Policy(gpu_batch_size=32, num_gpu_batches=2, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.0, cache_cpu=1.0)
    x = placement_vector(p)
    gpu_att = cost_terms(c, p, WORKLOAD, H200, 2, layout=model_layout(c)).decode["cpu->gpu"]
    cpu_att_terms = cost_terms(c, replace(p, cpu_attention=True), WORKLOAD, H200, 2, layout=model_layout(c))
    assert cpu_att_terms.decode["cpu->gpu"] @ [*x, 1] < gpu_att @ [*x, 1]
    # the executor waits for q/k/v before attending on the host: one serial compute channel, no overlap
    assert "compute" in cpu_att_terms.decode and "gpu compute" not in cpu_att_terms.decode
    serial = cpu_att_terms.decode["compute"] @ [*x, 1]
    slots = 2 * (H200.decode_slot_s + H200.cpu_attention_slot_s)
    assert serial > slots                              # slot latencies + host attention over the cache


SLOTS = replace(H200, slot_decode_ms=0.3, slot_gpu_cache_q4_ms=1.0, slot_off_cache_ms=0.6,
                slot_off_cache_q4_ms=2.0, cpu_attention_slot_ms=0.8)


@pytest.mark.parametrize("placement, compressed, per_slot_ms", [
    (dict(), False, 0.3),                                           # resident
    (dict(), True, 1.3),                                            # 4-bit cache on the gpu
    (dict(cache_gpu=0.0, cache_cpu=1.0), False, 0.9),               # dense cache off the gpu
    (dict(cache_gpu=0.0, cache_cpu=1.0), True, 2.3),                # 4-bit cache off the gpu
    (dict(cache_gpu=0.5, cache_cpu=0.5), True, 3.3),                # both segments
    (dict(cache_gpu=0.5, cache_cpu=0.5, act_gpu=0.5, act_cpu=0.5), True, 3.3),   # decode never parks hidden
])
def test_decode_slot_time_steps_with_what_the_slot_does(placement, compressed, per_slot_ms):
    c = preset("opt-6.7b")
    p = Policy(gpu_batch_size=8, num_gpu_batches=4, compress_cache=compressed, **placement)
    terms = cost_terms(c, p, WORKLOAD, SLOTS, 2, layout=model_layout(c))
    x = placement_vector(p)
    assert terms.decode_slots.seconds(x) * 1e3 == pytest.approx(per_slot_ms)
    # four GPU batches: four slots of host time per layer, in the "host" channel
    host = terms.at(x)[1]["host"] @ [*x, 1]
    assert host == pytest.approx(4 * per_slot_ms * 1e-3)


def test_weights_off_the_gpu_pay_per_slot_and_4bit_weights_per_layer():
    c = preset("opt-6.7b")
    profile = replace(SLOTS, slot_off_weights_ms=0.7, layer_q4_weights_ms=0.4)
    resident = Policy(gpu_batch_size=8, num_gpu_batches=4)
    streamed = replace(resident, w_gpu=0.5, w_cpu=0.5)
    packed = replace(resident, compress_weights=True)

    def host_ms(p):
        x = placement_vector(p)
        return 1e3 * (cost_terms(c, p, WORKLOAD, profile, 2, layout=model_layout(c)).at(x)[1]["host"] @ [*x, 1])
    assert host_ms(resident) == pytest.approx(4 * 0.3)
    assert host_ms(streamed) == pytest.approx(4 * (0.3 + 0.7))     # a page of copies in every slot
    assert host_ms(packed) == pytest.approx(4 * 0.3 + 0.4)         # dequantized once per layer and step


def test_cpu_attention_pays_its_slot_only_for_a_cache_off_the_gpu():
    c = preset("opt-6.7b")
    on_gpu = Policy(gpu_batch_size=8, num_gpu_batches=2, cpu_attention=True)
    off = replace(on_gpu, cache_gpu=0.0, cache_cpu=1.0)
    assert cost_terms(c, on_gpu, WORKLOAD, SLOTS, 2,
                      layout=model_layout(c)).decode_slots.seconds(placement_vector(on_gpu)) == \
        pytest.approx(0.3e-3)
    assert cost_terms(c, off, WORKLOAD, SLOTS, 2,
                      layout=model_layout(c)).decode_slots.seconds(placement_vector(off)) == \
        pytest.approx(1.1e-3)


def test_overlap_never_slower_than_serial():
    c = preset("opt-30b")
    p = Policy(gpu_batch_size=16, num_gpu_batches=4, w_gpu=0.2, w_cpu=0.8, cache_gpu=0.0, cache_cpu=1.0)
    fast = estimate(c, p, WORKLOAD, H200, layout=model_layout(c))
    slow = estimate(c, replace(p, overlap=False), WORKLOAD, H200, layout=model_layout(c))
    assert slow.tokens_per_s < fast.tokens_per_s


def test_peak_memory_homes_by_tier():
    c = preset("opt-6.7b")
    weights = ms.total_numel(c) * 2
    on_gpu = estimate(c, Policy(gpu_batch_size=8), WORKLOAD, H200, layout=model_layout(c))
    assert on_gpu.peak_memory_bytes["gpu"] > weights
    assert on_gpu.peak_memory_bytes["cpu"] == 0 and on_gpu.peak_memory_bytes["disk"] == 0
    on_disk = estimate(c, Policy(gpu_batch_size=8, w_gpu=0.0, w_cpu=0.0), WORKLOAD, H200, layout=model_layout(c))
    stored = model_layout(c, 2, False).total_bytes            # OPT's head keeps its own lm_head copy
    assert stored == pytest.approx(weights + c.vocab_size * c.hidden_size * 2)
    held = model_layout(c, 2, False).held_fraction("cuda") * stored   # embedding and head stay on the gpu
    assert held > 0
    assert on_disk.peak_memory_bytes["disk"] == pytest.approx(stored - held)
    assert on_disk.peak_memory_bytes["gpu"] < on_gpu.peak_memory_bytes["gpu"] - weights / 2
    assert on_disk.peak_memory_bytes["cpu"] > 0       # pinned relay buffers for the disk reads


def test_estimate_is_consistent():
    c = preset("mixtral-8x7b")
    p = Policy(gpu_batch_size=64, num_gpu_batches=4, w_gpu=0.1, w_cpu=0.9, cache_gpu=0.0, cache_cpu=1.0,
               cpu_attention=True)
    e = estimate(c, p, WORKLOAD, H200, layout=model_layout(c))
    assert e.total_s == pytest.approx(e.prefill_s + e.decode_s)
    assert e.tokens_per_s == pytest.approx(p.block_size * 32 / e.total_s)
    assert e.decode_bottleneck in ("cpu->gpu", "gpu->cpu", "disk->cpu", "cpu->disk", "gpu compute", "cpu compute")
    assert e.peak_memory_bytes["gpu"] < 139 * GIB


def _plain_and_ahead(config, shape: tuple[int, int], cache_gpu: float, workload: Workload, profile):
    """A `shape` (GPU batch size, GPU batches) policy with compressed weights on the cpu and `cache_gpu` of the
    cache on the GPU, with the ahead prefill; its decode slack; the estimates without and with the ahead prefill."""
    plain = Policy(gpu_batch_size=shape[0], num_gpu_batches=shape[1], w_gpu=0.0, w_cpu=1.0, cache_gpu=cache_gpu,
                   cache_cpu=1.0 - cache_gpu, compress_weights=True, compress_cache=True)
    ahead = replace(plain, prefill_ahead=True)
    layout = model_layout(config)
    slack = decode_slack(config, ahead, workload, profile, layout=layout)
    p, a = (estimate(config, pol, workload, profile, layout=layout) for pol in (plain, ahead))
    return ahead, slack, p, a


@pytest.mark.parametrize("shape, cache_gpu", [((512, 8), 0.0), ((1536, 1), 0.4), ((512, 1), 1.0)])
def test_ahead_prefill_hides_only_in_the_decodes_slack(shape, cache_gpu):
    """Over unbounded rows a block with the ahead prefill takes its plain decode D plus what of the prefill P
    the decode's slack (`decode_slack`: the step's share neither compute nor the host fills) cannot hide:
    D + max(0, P - slack x D). A host-bound decode (Llama-3-70B 512 x 8, the cache on the cpu) hides none."""
    config = config_from_hf(PRESETS["llama-3-70b"])
    profile, workload = reference_profile("h200"), Workload(200, 10, shared_prefix_len=150)
    ahead, slack, p, a = _plain_and_ahead(config, shape, cache_gpu, workload, profile)
    assert a.prefill_s == 0.0
    assert a.decode_s == pytest.approx(p.decode_s + max(0.0, p.prefill_s - slack * p.decode_s), rel=1e-6)
    assert (slack == 0.0) == (shape == (512, 8)) and 0.0 <= slack < 1.0
    assert decode_slack(config, replace(ahead, overlap=False), workload, profile, layout=model_layout(config)) == 0.0


@pytest.mark.parametrize("shape, cache_gpu", [((1536, 1), 0.4), ((512, 1), 1.0)])
def test_only_the_blocks_that_carry_a_prefill_pay_for_it(shape, cache_gpu):
    """Over 4 blocks the first block's prefill runs in series and each of the first three carries the next one's
    on its decode, paying what the slack cannot hide; the last carries none: a block takes P / 4 in series and
    D + 3/4 x max(0, P - slack x D). (Averaging the carried prefill over all four blocks' steps first hid it in
    the last block's slack, which runs after every prefill is done.)"""
    config = config_from_hf(PRESETS["llama-3-70b"])
    rows = 4 * shape[0] * shape[1]
    profile, workload = reference_profile("h200"), Workload(200, 10, shared_prefix_len=150, num_prompts=rows)
    ahead, slack, p, a = _plain_and_ahead(config, shape, cache_gpu, workload, profile)
    assert a.prefill_s == pytest.approx(p.prefill_s / 4)
    assert a.decode_s == pytest.approx(p.decode_s + 0.75 * max(0.0, p.prefill_s - slack * p.decode_s), rel=1e-6)
    assert p.prefill_s > slack * p.decode_s                  # the carried prefill does not fit the slack here


def test_a_measured_fused_kernel_prices_4bit_decode_attention():
    """With the fused kernel's costs measured, a 4-bit cache's own positions cost b x (ctx - prefix) x (kv heads x
    the per-kv-head cost + heads x the per-head cost) on the device, and no dequantizing pass; a shared prefix
    held once is priced by the roofline; a dense cache or a CPU device keeps the roofline."""
    c = preset("llama-3-70b")
    layout = model_layout(c)
    wl = Workload(200, 10, num_prompts=4608, shared_prefix_len=150)
    policy = Policy(gpu_batch_size=2304, num_gpu_batches=2, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.0, cache_cpu=1.0,
                    compress_weights=True, compress_cache=True)
    x = placement_vector(policy)

    def decode_compute(profile, pol=policy):
        terms = cost_terms(c, pol, wl, profile, 2, layout=layout.view(2, pol.compress_weights))
        return terms.decode["gpu compute"][:6] @ x + terms.decode["gpu compute"][6]

    slow = replace(H200, gpu_q4_attention_kv_ns=2.0, gpu_q4_attention_q_ns=1.0)
    fast = replace(slow, gpu_q4_attention_q_ns=0.5)
    own = 4608 * (200 + 10 / 2 - 150)                              # rows x the positions each row stores
    per_position_s = (c.num_key_value_heads * 2.0 + c.num_attention_heads * 1.0) * 1e-9
    assert decode_compute(slow) - decode_compute(fast) == pytest.approx(own * c.num_attention_heads * 0.5e-9)
    kv16 = ms.kv_bytes_per_token(c, 2)
    roofline_s = 4608 * (200 + 5) * max(kv16 / (H200.gpu_mem_gib_s * GIB),
                                         ms.attention_flops_per_token(c, 1.0) / (H200.gpu_tflops_bf16 * 1e12))
    dequant_s = own * kv16 / H200.dequant_bytes_s
    prefix_s = 4608 * 150 * roofline_s / (4608 * 205)
    assert decode_compute(slow) - decode_compute(H200) == pytest.approx(
        own * per_position_s + prefix_s - roofline_s - dequant_s)
    dense = replace(policy, compress_cache=False)
    assert decode_compute(slow, dense) == pytest.approx(decode_compute(H200, dense))
    on_cpu = replace(slow, device_type="cpu")
    assert decode_compute(on_cpu) == pytest.approx(decode_compute(replace(H200, device_type="cpu")))


def test_elementwise_passes_count_each_tokens_activation_traffic():
    """Llama-3-8B: norms 4h, rotary 2(a + kv), attention output a, residuals 6h, SiLU-and-product 3i elements;
    OPT-30B has no rotary and its ReLU moves 2i; Mixtral-8x7B's MLP is two experts', each with the token's copy in and out and its weighting (3h)."""
    assert ms.activation_bytes_per_token(preset("llama-3-8b"), 2) == 2 * (
        4 * 4096 + 2 * (4096 + 1024) + 4096 + 6 * 4096 + 3 * 14336)
    assert ms.activation_bytes_per_token(preset("opt-30b"), 2) == 2 * (     # no rotary; ReLU: no gate to read
        4 * 7168 + 7168 + 6 * 7168 + 2 * 28672)
    assert ms.activation_bytes_per_token(preset("mixtral-8x7b"), 2) == 2 * (
        4 * 4096 + 2 * (4096 + 1024) + 4096 + 6 * 4096 + 2 * (3 * 14336 + 3 * 4096))
    c = preset("llama-3-8b")
    policy = Policy(gpu_batch_size=64, w_gpu=1.0, w_cpu=0.0, cache_gpu=1.0, cache_cpu=0.0)
    plain = cost_terms(c, policy, WORKLOAD, H200, 2, layout=model_layout(c))
    none = replace(H200, gpu_mem_gib_s=1e12)              # bandwidth so high the passes cost nothing
    free = cost_terms(c, policy, WORKLOAD, none, 2, layout=model_layout(c))
    extra = (plain.prefill["gpu compute"][6] - free.prefill["gpu compute"][6])
    assert extra == pytest.approx(64 * 512 * ms.activation_bytes_per_token(c, 2) / (H200.gpu_mem_gib_s * GIB),
                                  rel=1e-6)
