"""Our model families against transformers on tiny random checkpoints: prefill + cached decode, left-padded."""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from engine.decoding.sampling import greedy
from engine.models.loader import load_model
from helpers.parity import ReferenceRunner, left_padded

KINDS = ["opt", "llama", "qwen2", "mistral", "mixtral"]


def check_parity(folder: Path, lengths: list[int], steps: int = 3, atol: float = 1e-4) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = ReferenceRunner(load_model(folder, dtype=torch.float32))
    ids, mask = left_padded(lengths, ours.m.config.vocab_size)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    past = None
    for step in range(steps + 1):
        with torch.no_grad():
            out = hf(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_kw: past})
            mine = ours.forward(ids, positions, mask.bool())
        ref = out.logits[:, -1].float()
        assert mine.dtype == torch.float32 and mine.shape == ref.shape
        err = (mine - ref).abs().max().item()
        assert err < atol, f"{folder.name} step {step}: max |diff| {err}"
        past = out[cache_kw] if cache_kw in out else out.past_key_values
        ids = mine.argmax(-1, keepdim=True)  # [b, 1]
        positions = positions[:, -1:] + 1
        mask = torch.cat([mask, torch.ones_like(ids)], dim=1)


@pytest.mark.parametrize("kind", KINDS)
def test_parity_single_prompt(tiny_checkpoints, kind):
    check_parity(tiny_checkpoints[kind], [7], steps=3)


@pytest.mark.parametrize("kind", KINDS)
def test_parity_left_padded_batch(tiny_checkpoints, kind):
    check_parity(tiny_checkpoints[kind], [5, 11, 2], steps=4)


def _save(config, path: Path) -> Path:
    import transformers

    torch.manual_seed(1)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(path)
    return path


def test_parity_opt_post_norm_with_projections(tmp_path):
    """OPT-350m's shape: LayerNorm after each block, word_embed_proj_dim != hidden_size (project_in/out)."""
    import transformers

    cfg = transformers.OPTConfig(
        vocab_size=300, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, word_embed_proj_dim=32, do_layer_norm_before=False,
    )
    check_parity(_save(cfg, tmp_path / "opt350"), [6, 3], steps=2)


def test_parity_llama_linear_rope_tied(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    check_parity(_save(cfg, tmp_path / "llama_linear"), [6, 3], steps=2)


def test_specs_fuse_and_mark_quantizable(tiny_checkpoints):
    m = load_model(tiny_checkpoints["llama"])
    attn = m.family.layer_specs()[1]
    qkv = attn.weights["qkv_proj.weight"]
    c = m.config
    assert qkv.shape == ((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size)
    assert len(qkv.sources) == 3 and qkv.quantizable
    assert not attn.weights["input_layernorm.weight"].quantizable
    moe = load_model(tiny_checkpoints["mixtral"])
    mlp = moe.family.layer_specs()[2].weights
    assert mlp["experts.w1"].shape == (4, 96, 64) and mlp["experts.w2"].shape == (4, 64, 96)
    w = moe.weights.get(moe.family.layer_specs()[2])
    assert w["experts.w3"].shape == (4, 96, 64)


@pytest.mark.parametrize("kind", ["opt", "llama"])
def test_head_logits_keep_the_hidden_dtype(tiny_checkpoints, kind):
    """A bfloat16 model's head gives bfloat16 logits (no float32 copy of the vocabulary); greedy over them picks
    what it picks over their float32 conversion."""
    m = load_model(tiny_checkpoints[kind], dtype=torch.bfloat16)
    head = m.family.layer_specs()[-1]
    hidden = torch.randn(4, m.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logits = m.family.head(m.weights.get(head), hidden)                                # [4, v]
    assert logits.dtype == torch.bfloat16 and logits.shape == (4, m.config.vocab_size)
    assert torch.equal(greedy(logits), logits.float().argmax(dim=-1))
