"""DeepSeek-V2/V3 (MLA attention, DeepSeek MoE) against transformers, through the executor.

Tiny random checkpoints built offline (`save_pretrained`; norms and V3's correction bias perturbed, embeddings
scaled up: `build_checkpoint_from_spec` of helpers/tiny_checkpoints.py), covering a q LoRA and a plain
q_proj, YaRN scaling with mscale != mscale_all_dim (cos/sin factor and softmax scale), group-limited routing
(V2) and V3's sigmoid + bias routing, interleaved and half-split RoPE, shared experts and a dense first layer.
8 prompts of different lengths: logits within 1e-4 (fp32) at the prefill and every decode step, greedy tokens
identical; the offloading policy matrix gives the in-memory run's tokens.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.hf_config import config_from_hf
from engine.models.loader import load_model
from engine.policy.policy import Policy
from helpers.greedy_runs import make_prompts, run_logits, run_policy
from helpers.offload_matrix import BASE, MATRIX, in_memory_runs
from helpers.parity import check_against_hf, check_shared_prefix_against_hf, compressed_drift
from helpers.skips import requires_cuda
from helpers.tiny_checkpoints import build_checkpoint_from_spec

_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
               max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32,
             beta_slow=1)
FAMILIES: dict[str, dict] = {
    "v2": dict(cls="DeepseekV2Config", topk_method="group_limited_greedy", n_group=4, topk_group=2,
               routed_scaling_factor=1.5, n_shared_experts=2,
               rope_parameters={**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}),
    "v2_lite_shape": dict(cls="DeepseekV2Config", q_lora_rank=None, n_shared_experts=1, v_head_dim=32),
    "v3": dict(cls="DeepseekV3Config", n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
               rope_parameters={**_YARN, "mscale": 1.0, "mscale_all_dim": 0.8}, num_nextn_predict_layers=0),
    "v3_half_split": dict(cls="DeepseekV3Config", n_group=2, topk_group=1, n_shared_experts=1, rope_interleave=False,
                          norm_topk_prob=False, num_nextn_predict_layers=0),
}
FEW = ["w_disk", "cache_disk_attn", "one_batch_all_off"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("deepseek")
    return {kind: (root / kind, build_checkpoint_from_spec({**_COMMON, **FAMILIES[kind]}, root / kind))
            for kind in FAMILIES}


def test_configs_map_to_our_fields(checkpoints):
    c = {kind: load_model(checkpoints[kind][0]).config for kind in FAMILIES}
    v2, lite, v3 = c["v2"], c["v2_lite_shape"], c["v3"]
    assert v2.architecture == "DeepseekV2ForCausalLM" and v3.architecture == "DeepseekV3ForCausalLM"
    assert v2.is_mla and v2.head_dim == 24 and v2.num_key_value_heads == 4 and lite.head_dim == 32
    assert v2.q_lora_rank == 48 and lite.q_lora_rank is None
    assert [v2.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert v2.topk_method == "group_limited_greedy" and v2.scoring_func == "softmax" and v2.rope_interleave
    assert v3.topk_method == "noaux_tc" and v3.scoring_func == "sigmoid" and v3.norm_topk_prob
    assert not c["v3_half_split"].rope_interleave and v2.rope_scaling["rope_type"] == "yarn"
    assert v2.attn_scale == pytest.approx(24 ** -0.5 * (0.1 * 0.707 * torch.tensor(4.0).log().item() + 1) ** 2)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_logits_and_greedy_match_transformers(checkpoints, kind):
    folder, hf = checkpoints[kind]
    loaded = load_model(folder, dtype=torch.float32)
    prompts = make_prompts(8, loaded.config.vocab_size, seed=11, lo=2, hi=40)
    assert len({len(p) for p in prompts}) >= 6
    sel = run_logits(loaded, Policy(gpu_batch_size=4, num_gpu_batches=2), prompts, [8] * 8)
    check_against_hf(hf, prompts, sel)


def test_shared_prefix_matches_transformers(checkpoints):
    folder, hf = checkpoints["v2"]
    check_shared_prefix_against_hf(folder, hf)


@pytest.fixture(scope="module")
def in_memory(checkpoints) -> dict:
    return in_memory_runs({kind: folder for kind, (folder, _) in checkpoints.items()}, ("v2", "v3"))


@pytest.mark.parametrize("kind, name", [("v2", n) for n in MATRIX] + [("v3", n) for n in FEW])
def test_offloading_policies_match_in_memory(in_memory, kind, name, tmp_path):
    loaded, prompts, max_new, ref = in_memory[kind]
    got, _ = run_policy(loaded, Policy(**{**BASE, **MATRIX[name]}), prompts, max_new, disk_dir=tmp_path)
    assert got == ref


def test_compressed_weights_and_cache_stay_close(checkpoints):
    """4-bit weights and cache (V's zero padding quantizes to zeros and is dropped): logits stay close."""
    assert compressed_drift(load_model(checkpoints["v2"][0], dtype=torch.float32)) < 0.15


def test_v3_multi_token_prediction_tensors_are_skipped(checkpoints, tmp_path):
    """A V3 checkpoint's MTP layer (model.layers.{num_hidden_layers}.*) loads and is unused; the same extra
    tensor in a V2 checkpoint is reported as unexpected."""
    for kind, nextn in (("v3", 1), ("v2", None)):
        folder = tmp_path / kind
        folder.mkdir()
        src = checkpoints[kind][0]
        tensors = load_file(str(src / "model.safetensors"))
        tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
        save_file(tensors, str(folder / "model.safetensors"))
        d = json.loads((src / "config.json").read_text())
        if nextn is not None:
            d["num_nextn_predict_layers"] = nextn
        (folder / "config.json").write_text(json.dumps(d))
        if kind == "v3":
            assert load_model(folder).config.num_nextn_predict_layers == 1
        else:
            with pytest.raises(ValueError, match="unexpected tensors.*layers.3.eh_proj"):
                load_model(folder)


_HUB = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def test_hub_config_spellings_and_refusals():
    lite = config_from_hf({**_HUB, "architectures": ["DeepseekV2ForCausalLM"], "rope_theta": 10000,
                           "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                                            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
                           "n_routed_experts": 8, "num_experts_per_tok": 2, "q_lora_rank": None,
                           "scoring_func": "softmax", "topk_method": "greedy", "num_key_value_heads": 128})
    assert lite.rope_scaling["rope_type"] == "yarn" and lite.num_key_value_heads == 4 and lite.num_local_experts == 8
    with pytest.raises(ValueError, match="topk_method 'noaux_tc' is not supported for DeepseekV2"):
        config_from_hf({**_HUB, "architectures": ["DeepseekV2ForCausalLM"], "topk_method": "noaux_tc"})
    with pytest.raises(ValueError, match="missing required field.*kv_lora_rank"):
        config_from_hf({**_HUB, "architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": None})
    with pytest.raises(ValueError, match="'yarn' is supported for .*DeepseekV2ForCausalLM.* not LlamaForCausalLM"):
        config_from_hf({**_HUB, "architectures": ["LlamaForCausalLM"],
                        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}})


@requires_cuda
@pytest.mark.parametrize("kind, name", [("v2", "w_disk"), ("v2", "cache_disk_attn"), ("v3", "one_batch_all_off")])
def test_cuda_matches_the_cpu_run(in_memory, kind, name, tmp_path):
    """On a GPU (fp32), offloading policies give the CPU in-memory run's tokens."""
    loaded, prompts, max_new, ref = in_memory[kind]
    got, _ = run_policy(loaded, Policy(**{**BASE, **MATRIX[name]}), prompts, max_new, device="cuda",
                        disk_dir=tmp_path)
    assert got == ref
