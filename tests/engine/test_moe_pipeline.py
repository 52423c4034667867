"""Every MoE policy (CGOPipe pipelining on/off, CPU attention on/off, paged weights, 4-bit) gives the greedy
tokens of the all-in-memory run: tiny random Mixtral, Qwen2-MoE and Qwen3-MoE from transformers, on the CPU
and (skipped without one) on CUDA."""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from engine.models.loader import load_model
from engine.policy.hardware import reference_profile
from engine.runtime import kv_cache
from engine.policy.policy import Policy
from helpers.budget_checks import check_budget_consistency
from helpers.greedy_runs import make_prompts, run_policy
from helpers.skips import requires_cuda
from helpers.tiny_checkpoints import build_family_checkpoint

BASE = dict(gpu_batch_size=3, num_gpu_batches=3)
W_OFF = dict(w_gpu=0.0, w_cpu=0.4)                       # the rest on disk: loads move, in pages, on a CPU too
CACHE_HOST = dict(cache_gpu=0.0, cache_cpu=1.0, cpu_attention=True)
POLICIES = {
    "pipelined_cpu_attn": dict(**CACHE_HOST),
    "pipelined_w_off_pages": dict(**CACHE_HOST, **W_OFF, weight_pages=5),
    "no_pipeline_cpu_attn": dict(**CACHE_HOST, **W_OFF, pipeline=False),
    "pipelined_split_cache": dict(cache_gpu=0.5, cache_cpu=0.5, cpu_attention=True, **W_OFF, weight_pages=2),
    "pipelined_disk_cache": dict(cache_gpu=0.0, cache_cpu=0.0, cpu_attention=True),
    "pipelined_4bit": dict(**CACHE_HOST, **W_OFF, compress_weights=True, compress_cache=True),
    "no_pipeline_4bit": dict(**CACHE_HOST, **W_OFF, compress_weights=True, compress_cache=True, pipeline=False),
    "pipelined_acts_off": dict(**CACHE_HOST, act_gpu=0.0, act_cpu=1.0),
    "pipelined_no_overlap": dict(**CACHE_HOST, **W_OFF, overlap=False),
    "gpu_attn_cache_cpu_pages": dict(cache_gpu=0.0, cache_cpu=1.0, **W_OFF, weight_pages=4),
    "one_batch_pipelined": dict(gpu_batch_size=9, num_gpu_batches=1, **CACHE_HOST, **W_OFF),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.fixture(scope="module")
def moe_models(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    paths = {"mixtral": tiny_checkpoints["mixtral"]}
    for kind in ("qwen2_moe", "qwen3_moe"):
        build_family_checkpoint(kind, root / kind)
        paths[kind] = root / kind
    return {kind: load_model(path, dtype=torch.float32) for kind, path in paths.items()}


def _prompts(loaded):
    return make_prompts(9, loaded.config.vocab_size, seed=7), [6, 9, 3, 9, 7, 9, 5, 9, 8]


@pytest.fixture(scope="module")
def references(moe_models):
    """(kind, device, 4-bit) -> tokens of the all-in-memory policy (4-bit weights and cache when compressed)."""
    out = {}
    for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        for kind, loaded in moe_models.items():
            prompts, max_new = _prompts(loaded)
            for q4 in (False, True):
                policy = Policy(**BASE, compress_weights=q4, compress_cache=q4)
                out[(kind, device, q4)] = run_policy(loaded, policy, prompts, max_new, device=device)[0]
    return out


QWEN_POLICIES = ["pipelined_w_off_pages", "no_pipeline_cpu_attn", "pipelined_split_cache", "pipelined_4bit"]
CASES = [("mixtral", name) for name in POLICIES] + [(kind, name) for kind in ("qwen2_moe", "qwen3_moe")
                                                     for name in QWEN_POLICIES]   # the full matrix on Mixtral


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,name", CASES)
def test_moe_policy_matches_in_memory(moe_models, references, kind, name, device, tmp_path):
    loaded = moe_models[kind]
    prompts, max_new = _prompts(loaded)
    verbs = []
    got, ex = run_policy(loaded, Policy(**{**BASE, **POLICIES[name]}), prompts, max_new, device=device,
                         disk_dir=tmp_path, hook=lambda a: verbs.append(a.verb))
    policy = ex.policy
    assert got == references[(kind, device, policy.compress_cache)]
    attention_layers = sum(1 for s in ex.specs if s.kind == "attention")
    pipelined = policy.pipeline and policy.cpu_attention           # every decode attention is joined
    assert verbs.count("join_attention") == (pipelined * (max(max_new) - 1) * attention_layers
                                             * policy.num_gpu_batches)
    assert ("prefetch_weight" in verbs) == (policy.pipeline and policy.compress_weights)   # experts ahead


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cpu_attention", [False, True])
def test_experts_loaded_ahead_past_an_ended_gpu_batch(moe_models, device, cpu_attention, tmp_path):
    """The experts loaded a layer ahead overwrite the previous expert layer's compressed buffer once the
    first compute of that layer has dequantized it; when that compute's GPU batch has already ended (it
    computes nothing), the load dequantizes the previous layer itself first. Batch 0 ends after two tokens,
    the others run on: the in-memory run's tokens."""
    loaded = moe_models["mixtral"]
    prompts, _ = _prompts(loaded)
    max_new = [2, 2, 2, 9, 7, 9, 5, 9, 8]
    ref = run_policy(loaded, Policy(**BASE, compress_weights=True, compress_cache=True), prompts, max_new,
                     device=device)[0]
    policy = Policy(**BASE, **W_OFF, cache_gpu=0.0, cache_cpu=1.0, cpu_attention=cpu_attention,
                    compress_weights=True, compress_cache=True)
    verbs = []
    got, _ = run_policy(loaded, policy, prompts, max_new, device=device, disk_dir=tmp_path,
                        hook=lambda a: verbs.append(a.verb))
    assert "prefetch_weight" in verbs
    assert got == ref


@pytest.mark.parametrize("device", DEVICES)
def test_cache_prefetched_at_the_head_is_loaded_again_after_a_compaction(moe_models, device, monkeypatch,
                                                                          tmp_path):
    """The next step's first cache loads leave at a step's head (`prefetch_cache`), before the head decides
    which rows end; a GPU batch that then compacts its rows loads those caches again from the compacted homes.
    Rows end at different steps, so batches compact with loads in flight: the in-memory run's tokens."""
    from engine.runtime.block_state import BlockState

    loaded = moe_models["mixtral"]
    prompts, _ = _prompts(loaded)
    max_new = [2, 9, 9, 3, 3, 9, 9, 4, 9]
    stale = []
    compact = BlockState.compact

    def spy(self, k):
        out = compact(self, k)
        stale.extend(out)
        return out
    monkeypatch.setattr(BlockState, "compact", spy)
    ref = run_policy(loaded, Policy(**BASE, compress_cache=True), prompts, max_new, device=device)[0]
    verbs = []
    policy = Policy(**BASE, **W_OFF, cache_gpu=0.0, cache_cpu=1.0, compress_cache=True)
    got, _ = run_policy(loaded, policy, prompts, max_new, device=device, disk_dir=tmp_path,
                        hook=lambda a: verbs.append(a.verb))
    assert verbs.count("prefetch_cache") == 2 * (max(max_new) - 1)
    assert stale and all(key[1] == 1 for key in stale)      # the first attention layer, loaded again
    assert got == ref


def test_pipelined_host_attention_runs_off_the_compute_thread(moe_models, monkeypatch):
    """The host part of a pipelined decode attention runs on the host-attention thread; without `pipeline`
    (the ablation) on the caller's."""
    loaded = moe_models["mixtral"]
    prompts, max_new = _prompts(loaded)
    seen = set()
    original = kv_cache.cpu_decode_attention

    def spy(*args, **kwargs):
        seen.add(threading.current_thread().name.split("_")[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(kv_cache, "cpu_decode_attention", spy)
    run_policy(loaded, Policy(**BASE, **CACHE_HOST), prompts, max_new)
    assert seen == {"engine-host-attn"}
    seen.clear()
    run_policy(loaded, Policy(**BASE, **CACHE_HOST, pipeline=False), prompts, max_new)
    assert seen == {"MainThread"}


def test_policy_rejects_negative_pages():
    with pytest.raises(ValueError, match="weight_pages"):
        Policy(weight_pages=-1)


@requires_cuda
@pytest.mark.parametrize("pipeline", [True, False])
def test_memory_accounting_with_the_pipeline_on_cuda(pipeline, tmp_path):
    """On CUDA the pipeline's pinned staging (`hattn`) is counted by the memory model exactly as the
    executor reserves it, and the budgets hold."""
    profile = replace(reference_profile("h200"), device_type="cuda")
    policy = Policy(gpu_batch_size=3, num_gpu_batches=2, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.5, cache_cpu=0.5,
                    cpu_attention=True, compress_weights=True, compress_cache=True, pipeline=pipeline,
                    weight_pages=3)
    check_budget_consistency("tiny-mixtral", policy, torch.device("cuda"), profile, tmp_path)
