"""The HF-folder families added for issue 18 against transformers, through the executor.

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
from engine.runtime.executor import Executor
from test_executor import GreedyRecorder, make_prompts, run_policy
from test_offload_matrix import MATRIX

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.1 * i for i in range(8)],
                 long_factor=[2.0 + 0.5 * i for i in range(8)])
FAMILIES: dict[str, dict] = {
    "qwen3": dict(cls="Qwen3Config", head_dim=32, tie_word_embeddings=False),
    "mistral_window": dict(cls="MistralConfig", num_key_value_heads=1, sliding_window=8),
    "qwen2_moe": dict(cls="Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False, num_hidden_layers=3,
                      mlp_only_layers=[1]),
    "qwen3_moe": dict(cls="Qwen3MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, head_dim=32),
    "gemma2": dict(cls="Gemma2Config", head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                   attn_logit_softcapping=0.5, final_logit_softcapping=0.3, num_hidden_layers=3),
    "gemma3": dict(cls="Gemma3TextConfig", head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_hidden_layers=3,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "phi3": dict(cls="Phi3Config", rope_parameters=_LONGROPE, original_max_position_embeddings=64),
}
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "mistral_window": "MistralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
POLICIES = ["w_disk", "cache_disk_attn", "one_batch_all_off"]   # weights on gpu/cpu/disk, cache on disk with
# cpu attention, and everything off with one GPU batch (the full matrix runs for llama/opt/mixtral)
BASE = dict(gpu_batch_size=3, num_gpu_batches=3)


def build_checkpoint_from_spec(spec: dict, path: Path):
    """Save a tiny random transformers model of config `spec` ({"cls": config class name, **fields}) to `path`
    with its norms and router biases perturbed and embeddings scaled up; return it (eager attention)."""
    import transformers

    spec = dict(spec)
    config = getattr(transformers, spec.pop("cls"))(**spec)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:                                   # norms: not all ones / zeros
                p.add_(torch.randn_like(p) * 0.2)
            elif "embed" in name:
                p.mul_(5.0)                                    # logits large enough for the caps to bite
        for module in model.modules():
            if getattr(module, "e_score_correction_bias", None) is not None:
                module.e_score_correction_bias.normal_(0.0, 0.1)   # a buffer: steers DeepSeek-V3's choice
    model.save_pretrained(path)
    return model


def build_family_checkpoint(kind: str, path: Path):
    """Save a tiny random transformers model of `kind` (a FAMILIES key) to `path`; return it (eager attention)."""
    return build_checkpoint_from_spec({**_COMMON, **FAMILIES[kind]}, path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("families")
    return {kind: (root / kind, build_family_checkpoint(kind, root / kind)) for kind in FAMILIES}


class LogitRecorder(GreedyRecorder):
    """GreedyRecorder that also keeps every step's logits per row."""

    def __init__(self):
        super().__init__()
        self.logits: dict[int, list[torch.Tensor]] = {}

    def __call__(self, rows, logits):
        for r, row in zip(rows, logits):
            self.logits.setdefault(r, []).append(row.clone())
        return super().__call__(rows, logits)


def _run(loaded, policy, prompts, max_new, disk_dir=None, device: torch.device = torch.device("cpu"),
         **executor_kwargs) -> LogitRecorder:
    ex = Executor(loaded, policy, device=device, dtype=torch.float32, disk_dir=disk_dir, **executor_kwargs)
    try:
        sel = LogitRecorder()
        ex.generate_block(prompts, max_new, sel)
        return sel
    finally:
        ex.close()


def _check_against_hf(hf, prompts, sel: LogitRecorder, atol: float = 1e-4) -> None:
    """Teacher-forced transformers logits of prompt + our tokens equal ours at every step; argmax equal."""
    with torch.inference_mode():
        for r, p in enumerate(prompts):
            ids = torch.tensor([p + sel.tokens[r][:-1]])
            ref = hf(input_ids=ids).logits[0, len(p) - 1:].float()  # [steps, v]
            mine = torch.stack(sel.logits[r])  # [steps, v]
            err = (mine - ref).abs().max().item()
            assert err < atol, f"row {r} (prompt length {len(p)}): max |logit diff| {err}"
            assert ref.argmax(-1).tolist() == sel.tokens[r], f"row {r}: greedy tokens differ"


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
    sel = _run(loaded, Policy(gpu_batch_size=4, num_gpu_batches=2), prompts, [8] * 8)
    _check_against_hf(hf, prompts, sel)


@pytest.mark.parametrize("kind", ["mistral_window", "gemma2", "gemma3"])
def test_shared_prefix_longer_than_window_matches_transformers(checkpoints, kind):
    folder, hf = checkpoints[kind]
    loaded = load_model(folder, dtype=torch.float32)
    prefix = make_prompts(1, loaded.config.vocab_size, seed=12, lo=12, hi=13)[0]
    prompts = [prefix + p for p in make_prompts(6, loaded.config.vocab_size, seed=13, lo=1, hi=12)]
    sel = _run(loaded, Policy(gpu_batch_size=3, num_gpu_batches=2), prompts, [6] * 6)
    _check_against_hf(hf, prompts, sel)


def in_memory_runs(checkpoints: dict, kinds) -> dict:
    """Per kind: (loaded, prompts, max_new, tokens of the all-in-memory policy)."""
    out = {}
    for kind in kinds:
        loaded = load_model(checkpoints[kind][0], dtype=torch.float32)
        prompts = make_prompts(9, loaded.config.vocab_size, seed=3)
        max_new = [6, 9, 3, 9, 7, 9, 5, 9, 8]
        out[kind] = (loaded, prompts, max_new, run_policy(loaded, Policy(**BASE), prompts, max_new)[0])
    return out


@pytest.fixture(scope="module")
def in_memory(checkpoints) -> dict:
    return in_memory_runs(checkpoints, FAMILIES)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_offloading_policies_match_in_memory(in_memory, kind, name, tmp_path):
    loaded, prompts, max_new, ref = in_memory[kind]
    got, _ = run_policy(loaded, Policy(**{**BASE, **MATRIX[name]}), prompts, max_new, disk_dir=tmp_path)
    assert got == ref


def compressed_drift(loaded) -> float:
    """Relative change of the first step's logits (4 prompts) under 4-bit weights + 4-bit cache on the cpu with
    cpu attention, against the dense run; asserts they are finite."""
    prompts = make_prompts(4, loaded.config.vocab_size, seed=6)
    ref = _run(loaded, Policy(gpu_batch_size=4), prompts, [4] * 4)
    got = _run(loaded, Policy(gpu_batch_size=4, compress_weights=True, compress_cache=True, cache_gpu=0.0,
                              cache_cpu=1.0, cpu_attention=True), prompts, [4] * 4)
    a, b = torch.stack([ref.logits[r][0] for r in range(4)]), torch.stack([got.logits[r][0] for r in range(4)])
    assert torch.isfinite(b).all()
    return ((b - a).norm() / a.norm()).item()


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
