"""The CPU decode step's elementwise ops: aten's fused RMSNorm statistics give the explicit formula's bits, and
a RoPE table gathers cos/sin once per positions tensor (every layer of a step passes the same one)."""
from __future__ import annotations

import pytest
import torch

from engine.models.elementwise import rms_norm_torch
from engine.models.config import ModelConfig
from engine.models.layers import RopeTable, rope_inv_freq


def explicit_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face Llama's RMSNorm, op by op."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [64, 576, 960, 4096])
@pytest.mark.parametrize("rows", [1, 15, 64])
def test_rms_norm_bits_equal_the_explicit_formula(dtype, width, rows):
    gen = torch.Generator().manual_seed(width + rows)
    x = (4 * torch.randn(rows, 3, width, generator=gen)).to(dtype)
    w = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    assert torch.equal(rms_norm_torch(x, w, 1e-5), explicit_rms_norm(x, w, 1e-5))


def test_rms_norm_strided_input():
    x = torch.randn(3, 2, 200)[..., :100]                                      # row stride 200
    w = torch.rand(100) + 0.5
    assert torch.equal(rms_norm_torch(x, w, 1e-6), explicit_rms_norm(x, w, 1e-6))


def test_rope_lookup_gathers_once_per_positions_tensor():
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=64)
    table = RopeTable(rope_inv_freq(config))
    step = torch.tensor([[5], [9]])
    cos, sin = table.lookup(step, torch.float32)
    again = table.lookup(step, torch.float32)
    assert again[0] is cos and again[1] is sin                                   # the same step: no gather
    later = table.lookup(step + 1, torch.float32)                                # the next step's positions
    assert not torch.equal(later[0], cos)
    assert torch.equal(later[0], table.lookup(torch.tensor([[6], [10]]), torch.float32)[0])
    assert table.lookup(step, torch.bfloat16)[0].dtype == torch.bfloat16          # another dtype: its own


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_rotates_q_and_k_in_one_pass_with_the_same_bits(tiny_checkpoints, dtype):
    from engine.models.layers import apply_rope
    from engine.models.loader import load_model

    loaded = load_model(tiny_checkpoints["qwen2"], dtype=dtype)                     # q/k/v bias too
    f = loaded.family
    w = loaded.weights.get(f.layer_specs()[1])
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, loaded.config.hidden_size, generator=gen).to(dtype)
    positions = torch.arange(5).repeat(3, 1) + torch.tensor([[0], [2], [7]])
    cos, sin = f.rope.lookup(positions, dtype)
    q, k, v = f.qkv_heads(w, x)
    joint = f.qkv_rotated(w, x, cos, sin)
    for got, want in zip(joint, (apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous())):
        assert got.shape == want.shape and torch.equal(got, want)
