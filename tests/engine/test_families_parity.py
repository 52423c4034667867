"""Qwen3, Qwen-MoE, Gemma2/3, Phi3 and Mistral's sliding window against transformers, through the executor.

Each family: a tiny random checkpoint built offline (`save_pretrained`; norms perturbed so that (1 + w)
norms and q/k norms are exercised), 8 prompts of different lengths (several longer than the tiny sliding
windows), logits within 1e-4 (fp32) at the prefill and every decode step (teacher-forced transformers
forwards of prompt + our tokens) and greedy tokens identical; then offloading policies (weights on cpu/disk,
cache on cpu with cpu attention, cache on disk, everything off) give the in-memory run's tokens, a shared
prefix longer than the window matches transformers, and compression stays close.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models.loader import load_model
from engine.policy.policy import Policy
from helpers.greedy_runs import make_prompts, run_logits, run_policy
from helpers.offload_matrix import BASE, MATRIX, in_memory_runs
from helpers.parity import check_against_hf, check_shared_prefix_against_hf, compressed_drift
from helpers.tiny_checkpoints import FAMILIES, build_family_checkpoint

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "mistral_window": "MistralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
POLICIES = ["w_disk", "cache_disk_attn", "one_batch_all_off"]   # weights on gpu/cpu/disk, cache on disk with
# cpu attention, and everything off with one GPU batch (the full matrix runs for llama/opt/mixtral)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("families")
    return {kind: (root / kind, build_family_checkpoint(kind, root / kind)) for kind in FAMILIES}


def test_configs_map_to_our_fields(checkpoints):
    c = {kind: load_model(checkpoints[kind][0]).config for kind in FAMILIES}
    assert {kind: cfg.architecture for kind, cfg in c.items()} == ARCHITECTURES
    assert c["mistral_window"].layer_window(0) == 8 and c["mistral_window"].layer_window(1) == 8
    assert [c["gemma2"].layer_window(i) for i in range(3)] == [8, None, 8]
    assert [c["gemma3"].layer_window(i) for i in range(3)] == [8, None, 8]
    assert c["gemma3"].rope_local_base_freq == 1e4 and c["gemma3"].rope_scaling["rope_type"] == "linear"
    assert c["gemma2"].attn_logit_softcapping == 0.5 and c["gemma2"].attn_scale == 24 ** -0.5
    assert c["qwen3"].head_dim == 32 and c["qwen3"].layer_window(0) is None
    q2 = c["qwen2_moe"]
    assert q2.num_local_experts == 4 and not q2.norm_topk_prob and q2.attention_bias
    assert [q2.is_moe_layer(i) for i in range(3)] == [True, False, True]
    assert c["qwen3_moe"].norm_topk_prob and c["qwen3_moe"].shared_expert_intermediate_size == 0
    assert c["phi3"].rope_scaling["rope_type"] == "longrope"


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_logits_and_greedy_match_transformers(checkpoints, kind):
    folder, hf = checkpoints[kind]
    loaded = load_model(folder, dtype=torch.float32)
    prompts = make_prompts(8, loaded.config.vocab_size, seed=11, lo=2, hi=40)
    assert len({len(p) for p in prompts}) >= 6 and max(len(p) for p in prompts) > 2 * 8
    sel = run_logits(loaded, Policy(gpu_batch_size=4, num_gpu_batches=2), prompts, [8] * 8)
    check_against_hf(hf, prompts, sel)


@pytest.mark.parametrize("kind", ["mistral_window", "gemma2", "gemma3"])
def test_shared_prefix_longer_than_window_matches_transformers(checkpoints, kind):
    folder, hf = checkpoints[kind]
    check_shared_prefix_against_hf(folder, hf)


@pytest.fixture(scope="module")
def in_memory(checkpoints) -> dict:
    return in_memory_runs({kind: folder for kind, (folder, _) in checkpoints.items()}, FAMILIES)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_offloading_policies_match_in_memory(in_memory, kind, name, tmp_path):
    loaded, prompts, max_new, ref = in_memory[kind]
    got, _ = run_policy(loaded, Policy(**{**BASE, **MATRIX[name]}), prompts, max_new, disk_dir=tmp_path)
    assert got == ref


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_compressed_weights_and_cache_stay_close(checkpoints, kind):
    drift = compressed_drift(load_model(checkpoints[kind][0], dtype=torch.float32))
    # the tiny Gemmas' inputs are large (embeddings x5 here, x sqrt(h) by Gemma) and Gemma2's caps (0.5 on
    # scores, 0.3 on logits) saturate tanh: 4-bit weights + cache move their logits more (measured 0.30, 0.26
    # with the weights in groups of 64; 0.26, 0.25 in groups of 32)
    assert drift < (0.35 if kind.startswith("gemma") else 0.15)


def test_longrope_switches_to_long_factors_past_the_original_context(checkpoints):
    """Positions >= original_max_position_embeddings use the long factors (transformers' rotary embedding
    over a sequence that long), earlier ones the short factors; both times the attention factor."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    folder, hf = checkpoints["phi3"]
    family = load_model(folder).family
    x = torch.zeros(1, 1, dtype=torch.float32)
    for positions in (torch.arange(0, 60)[None], torch.arange(0, 100)[None]):
        ref_cos, ref_sin = Phi3RotaryEmbedding(hf.config)(x, positions)   # [1, n, hd]
        cos, sin = family.rope.lookup(positions, torch.float32)
        part = slice(0, 60) if positions.shape[1] == 60 else slice(64, 100)
        assert torch.allclose(cos[:, part], ref_cos[:, part], atol=1e-5)
        assert torch.allclose(sin[:, part], ref_sin[:, part], atol=1e-5)
    assert family.rope.mscale > 1.0


_HUB_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4)


@pytest.mark.parametrize("d, windows", [
    # Mistral-7B-v0.1: every layer slides
    (dict(architectures=["MistralForCausalLM"], sliding_window=4096), [4096] * 4),
    # Qwen2.5: a window in config.json that is off
    (dict(architectures=["Qwen2ForCausalLM"], sliding_window=32768, use_sliding_window=False, max_window_layers=2),
     [None] * 4),
    # Qwen2 with use_sliding_window: layers from max_window_layers on slide
    (dict(architectures=["Qwen2ForCausalLM"], sliding_window=16, use_sliding_window=True, max_window_layers=2),
     [None, None, 16, 16]),
    # Qwen1.5-MoE: sliding_window 0 means none
    (dict(architectures=["Qwen2MoeForCausalLM"], sliding_window=0, num_experts=4, num_experts_per_tok=2), [None] * 4),
    # Gemma2 (4.x config.json, no layer_types): even layers slide
    (dict(architectures=["Gemma2ForCausalLM"], sliding_window=4096), [4096, None, 4096, None]),
    # Gemma3 (4.x): sliding_window_pattern
    (dict(architectures=["Gemma3ForCausalLM"], sliding_window=512, sliding_window_pattern=2), [512, None, 512, None]),
    # Phi-3-mini: every layer slides
    (dict(architectures=["Phi3ForCausalLM"], sliding_window=2047), [2047] * 4),
])
def test_hub_config_spellings_give_windows(d, windows):
    from engine.models.hf_config import config_from_hf

    c = config_from_hf({**_HUB_BASE, **d})
    assert [c.layer_window(i) for i in range(4)] == windows


def test_hub_config_spellings_of_rope():
    from engine.models.hf_config import config_from_hf

    gemma3 = config_from_hf({**_HUB_BASE, "architectures": ["Gemma3ForCausalLM"], "rope_theta": 1e6,
                             "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                             "query_pre_attn_scalar": 168, "hidden_activation": "gelu_pytorch_tanh"})
    assert gemma3.rope_theta == 1e6 and gemma3.rope_local_base_freq == 1e4
    assert gemma3.rope_scaling == {"rope_type": "linear", "factor": 8.0} and gemma3.hidden_act == "gelu_pytorch_tanh"
    phi = config_from_hf({**_HUB_BASE, "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 4096,
                          "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}})
    assert phi.rope_scaling["rope_type"] == "longrope"
    assert phi.rope_scaling["original_max_position_embeddings"] == 4096
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        config_from_hf({**_HUB_BASE, "architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75})
