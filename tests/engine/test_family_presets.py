"""Dummy presets of benchmark shapes (Qwen3, Qwen3-MoE, Gemma 3, Llama-3.1-405B, DeepSeek-V2-Lite): each builds
its config and family, its parameter count matches the published size and the layer specs (model_stats is exact
for them), and the policy search and estimate run under a 16 GiB GPU budget."""
from __future__ import annotations

import pytest

import engine.policy.model_stats as ms
from engine.models.hf_config import config_from_hf
from engine.models.presets import PRESETS
from engine.models.registry import build_family
from engine.policy.cost_model import Workload, estimate
from engine.policy.estimate import Budgets
from engine.policy.hardware import GIB, reference_profile
from engine.policy.search import search
from engine.runtime.layout import model_layout

H200 = reference_profile("h200")
WORKLOAD = Workload(prompt_len=512, gen_len=32)
# name -> (architecture, published parameters, activated parameters per token incl. embed + head)
NEW = {
    "qwen3-32b": ("Qwen3ForCausalLM", 32.8e9, None),
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", 30.5e9, 3.3e9),
    "gemma-3-27b": ("Gemma3ForCausalLM", 27.0e9, None),   # the text model (27.4B with the vision tower)
    "llama-3.1-405b": ("LlamaForCausalLM", 405.9e9, None),
    "deepseek-v2-lite": ("DeepseekV2ForCausalLM", 15.7e9, 2.4e9),   # published: 15.7B, 2.4B activated
}
# activated parameters as published: Qwen counts the embedding and head, DeepSeek the head only
_ACTIVE_EDGES = {"deepseek-v2-lite": ("head",)}


@pytest.mark.parametrize("name", list(NEW))
def test_preset_builds_and_counts(name):
    arch, params, active = NEW[name]
    c = config_from_hf(PRESETS[name])
    assert c.architecture == arch
    specs = build_family(c).layer_specs()
    assert len(specs) == 2 * c.num_hidden_layers + 2
    unique = {ws.sources: ws.numel for s in specs for ws in s.weights.values()}   # tied embedding once
    assert sum(unique.values()) == ms.total_numel(c)
    assert ms.total_numel(c) == pytest.approx(params, rel=0.01)
    if active is not None:
        parts = _ACTIVE_EDGES.get(name, ("embed", "head"))
        edges = sum(getattr(ms, f"{p}_numel")(c) for p in parts)
        assert ms.active_matmul_numel(c) * c.num_hidden_layers + edges == pytest.approx(active, rel=0.03)


def test_deepseek_v2_lite_preset_shape():
    """MLA: the cache holds 16 heads x 192 (V padded from 128) per token and layer; one dense first layer."""
    c = config_from_hf(PRESETS["deepseek-v2-lite"])
    assert c.is_mla and c.head_dim == 192 and c.num_key_value_heads == 16 and c.q_lora_rank is None
    assert ms.kv_bytes_per_token(c, 2) == 2 * 16 * 192 * 2
    assert [c.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert ms.total_numel(c) < ms.embed_numel(c) + ms.head_numel(c) + c.num_hidden_layers * ms.layer_numel(c)
    layout = model_layout(c, 2, False)
    assert layout.total_bytes == 2 * ms.total_numel(c) + 2 * ms.embed_numel(c) * c.tie_word_embeddings
    assert sorted(k.count for k in layout.kinds if k.kind == "mlp") == [1, 26]


def test_gemma3_preset_interleaves_windows():
    c = config_from_hf(PRESETS["gemma-3-27b"])
    windows = [c.layer_window(i) for i in range(c.num_hidden_layers)]
    assert windows[:6] == [1024] * 5 + [None] and windows.count(None) == 10
    assert c.attn_scale == 168 ** -0.5 and c.rope_local_base_freq == 1e4


@pytest.mark.parametrize("name", list(NEW))
def test_policy_search_and_estimate_accept_preset(name):
    c = config_from_hf(PRESETS[name])
    layout = model_layout(c, 2, True)
    assert layout.total_bytes > 0
    budgets = Budgets(16 * GIB, 200 * GIB, 2000 * GIB)
    result = search(c, WORKLOAD, budgets, H200, compress_weights=None, compress_cache=None,
                    layout=model_layout(c))   # search may choose
    assert result.predicted_tokens_per_s > 0
    for tier in ("gpu", "cpu", "disk"):
        assert result.peak_memory_bytes[tier] <= budgets.of(tier) * 0.95 + 1
    again = estimate(c, result.policy, WORKLOAD, H200, layout=model_layout(c))
    assert again.tokens_per_s == pytest.approx(result.predicted_tokens_per_s)
