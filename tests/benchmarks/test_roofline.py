"""benchmarks/throughput/roofline.py: the transfer floor counts what the policy must move per decode step."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: `benchmarks.*`
from benchmarks.throughput.roofline import cache_load_bytes, refloor, roofline  # noqa: E402

from engine.models.hf_config import config_from_hf  # noqa: E402
from engine.models.presets import PRESETS  # noqa: E402
from engine.policy import model_stats as ms  # noqa: E402
from engine.policy.hardware import GIB, reference_profile  # noqa: E402
from engine.policy.policy import Policy  # noqa: E402

H200 = reference_profile("h200")
MIXTRAL = config_from_hf(PRESETS["mixtral-8x7b"])
HOST_CACHE = Policy(gpu_batch_size=1024, w_gpu=0.5, w_cpu=0.5, cache_gpu=0.0, cache_cpu=1.0,
                    compress_weights=True, compress_cache=True)


def test_gpu_attention_over_a_host_cache_loads_its_own_positions():
    own = 77 + 64
    want = 1024 * own * MIXTRAL.num_hidden_layers * ms.kv_bytes_per_token(MIXTRAL, 2, True)
    assert cache_load_bytes(MIXTRAL, HOST_CACHE, H200, 2, rows=1024, own_context_len=own) == pytest.approx(want)
    half = Policy.from_dict({**HOST_CACHE.to_dict(), "cache_gpu": 0.5, "cache_cpu": 0.5})
    assert cache_load_bytes(MIXTRAL, half, H200, 2, rows=1024, own_context_len=own) == pytest.approx(want / 2)
    on_gpu = Policy.from_dict({**HOST_CACHE.to_dict(), "cache_gpu": 1.0, "cache_cpu": 0.0})
    host_attention = Policy.from_dict({**HOST_CACHE.to_dict(), "cpu_attention": True})
    for p in (on_gpu, host_attention):
        assert cache_load_bytes(MIXTRAL, p, H200, 2, rows=1024, own_context_len=own) == 0.0


def test_decode_floor_adds_the_cache_to_the_weights_on_the_link():
    kw = dict(rows=1024, prefill_tokens=1024 * 77, prompt_len=77, gen_len=128)
    host = roofline(MIXTRAL, HOST_CACHE, H200, **kw)
    assert host["decode_transfer_floor_step_s"] == pytest.approx(
        host["weight_floor_step_s"] + host["cache_load_step_bytes"] / (H200.h2d_gib_s * GIB))
    assert host["decode_floor_step_s"] >= host["decode_transfer_floor_step_s"]
    # a shared prefix held once on the device is not loaded: fewer bytes with the same rows
    shared = roofline(MIXTRAL, HOST_CACHE, H200, **{**kw, "prompt_len": 200}, prefix_len=150)
    alone = roofline(MIXTRAL, HOST_CACHE, H200, **{**kw, "prompt_len": 200})
    assert shared["cache_load_step_bytes"] < alone["cache_load_step_bytes"] / 2


def test_the_last_block_holds_the_rest_of_the_rows():
    """512 rows at 384 a block run as 384 + 128: with the ahead prefill the first block's prefill (3/4 of the
    compute) stays in series and the second's rides on its decode steps; two blocks of 256 would put half in
    series. Without it every block's prefill is in series and each decode step costs at least its transfer."""
    pol = Policy(gpu_batch_size=384, w_gpu=0.5, w_cpu=0.5, compress_weights=True, compress_cache=True,
                 prefill_ahead=True)
    kw = dict(rows=512, prefill_tokens=512 * 512, prompt_len=512, gen_len=32)
    uneven = roofline(MIXTRAL, pol, H200, **kw)
    assert uneven["block_rows"] == [384, 128]
    assert uneven["prefill_floor_s"] == pytest.approx(
        max(uneven["weight_floor_step_s"], 0.75 * uneven["prefill_compute_floor_s"]))
    even = roofline(MIXTRAL, Policy.from_dict({**pol.to_dict(), "gpu_batch_size": 256}), H200, **kw)
    assert even["block_rows"] == [256, 256]
    assert even["prefill_floor_s"] == pytest.approx(
        max(even["weight_floor_step_s"], 0.5 * even["prefill_compute_floor_s"]))
    assert uneven["floor_s"] > even["floor_s"]
    series = roofline(MIXTRAL, Policy.from_dict({**pol.to_dict(), "prefill_ahead": False}), H200, **kw)
    assert series["prefill_floor_s"] >= series["prefill_compute_floor_s"]
    assert series["decode_floor_s"] >= 2 * 31 * series["weight_floor_step_s"]


def test_refloor_recomputes_a_records_fraction_and_skips_peers():
    """An old record's fraction under the current floor: its total (tokens / tok/s) against `roofline` of its
    own policy and shape; a peer's record (Accelerate's policy is not ours) and an unfinished one give None."""
    pol = Policy(gpu_batch_size=384, w_gpu=0.5, w_cpu=0.5, compress_weights=True, compress_cache=True,
                 prefill_ahead=True)
    floor = roofline(MIXTRAL, pol, H200, rows=512, prefill_tokens=512 * 512, prompt_len=512, gen_len=32)
    rec = {"system": "llmops", "ok": True, "model": "mixtral-8x7b", "policy": pol.to_dict(), "num_prompts": 512,
           "prompt_len": 512, "gen_len": 32, "generated_tokens": 16384, "tokens_per_s": 16384 / 40.0,
           "roofline_fraction": 0.5}
    now = refloor(rec)
    assert now["fraction"] == pytest.approx(floor["floor_s"] / 40.0) and now["recorded_fraction"] == 0.5
    assert now["block_rows"] == [384, 128]
    assert refloor({**rec, "system": "accelerate", "policy": {"batch": 256}}) is None
    assert refloor({**rec, "ok": False}) is None


def test_an_ahead_prefill_overlaps_with_a_shared_prefix_too():
    """The executor runs a block's prefill ahead whatever the prompts share (`buffers.runs_ahead`), computing a
    shared prefix once per GPU batch there: the first block's prefill stays in series, the others ride on the
    decode steps, as without a prefix."""
    llama = config_from_hf(PRESETS["llama-3-70b"])
    pol = Policy(gpu_batch_size=1536, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.125, cache_cpu=0.875,
                 compress_weights=True, compress_cache=True, prefill_ahead=True)
    kw = dict(rows=4608, prefill_tokens=4608 * 50 + 3 * 150, prompt_len=200, gen_len=10, prefix_len=150)
    ahead = roofline(llama, pol, H200, **kw)
    series = roofline(llama, Policy.from_dict({**pol.to_dict(), "prefill_ahead": False}), H200, **kw)
    assert ahead["prefill_floor_s"] == pytest.approx(
        max(ahead["weight_floor_step_s"], ahead["prefill_compute_floor_s"] / 3))
    assert series["prefill_floor_s"] == pytest.approx(series["prefill_compute_floor_s"])
    assert ahead["floor_s"] < series["floor_s"]
