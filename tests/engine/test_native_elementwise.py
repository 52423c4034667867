"""The CPU C kernels for RMSNorm, RoPE and silu(gate) * up (engine.models.native_elementwise) against the torch
references, and `engine.models.elementwise`'s routing to them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models import elementwise, native_elementwise as ne
from engine.models.elementwise_torch import close_to_torch, rms_norm_torch, rope_torch, silu_mul_torch
from helpers.native_kernels import failing_build

needs_kernels = pytest.mark.skipif(ne._library() is None,
                                   reason="no AVX512-BF16 CPU or C compiler: the kernels are not built")


def _bf16(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("shape,width", [((1, 1, 576), 576), ((64, 1, 576), 576), ((3, 7, 100), 100),
                                         ((2, 5, 896), 896), ((4, 2, 9), 9)])
def test_rms_norm_within_two_units_of_the_torch_ops(shape, width):
    x = _bf16(*shape[:-1], 2 * width)[..., :width] * 3                   # rows at a stride of 2 x width
    w = (1 + 0.2 * _bf16(width, seed=1))
    got = ne.native_rms_norm(x, w, 1e-5)
    assert got is not None and got.shape == x.shape and got.is_contiguous()
    assert close_to_torch(got, rms_norm_torch(x, w, 1e-5), ulps=2)


@needs_kernels
@pytest.mark.parametrize("hd", [32, 64, 128])
@pytest.mark.parametrize("cos_rows", [1, 3])
def test_rope_equals_the_torch_ops_bit_for_bit_in_both_layouts(hd, cos_rows):
    qkv = _bf16(3, 5, 14, hd)                                            # [b, s, heads + spare, hd]
    x2 = qkv[:, :, :12]                                                  # [b, s, n, hd], strided as a projection's
    cos, sin = _bf16(cos_rows, 5, hd, seed=1), _bf16(cos_rows, 5, hd, seed=2)
    assert torch.equal(ne.native_rope(x2, cos, sin, head_dim=2), rope_torch(x2, cos, sin, head_dim=2))
    x1 = x2.transpose(1, 2)                                              # [b, n, s, hd]
    got = ne.native_rope(x1, cos, sin, head_dim=1)
    assert got.shape == x1.shape and torch.equal(got, rope_torch(x1, cos, sin))


@needs_kernels
@pytest.mark.parametrize("rows,k", [(1, 1536), (64, 1536), (5, 200), (3, 7)])
def test_silu_mul_within_two_units_of_the_torch_ops(rows, k):
    gate, up = (4 * _bf16(rows, 2 * k)).chunk(2, dim=-1)                 # views at a row stride of 2k
    got = ne.native_silu_mul(gate, up)
    assert got is not None and got.is_contiguous()
    assert close_to_torch(got, silu_mul_torch(gate, up), ulps=2)


@needs_kernels
def test_the_layer_ops_take_the_kernels_for_bfloat16_on_the_cpu():
    x, w = _bf16(4, 1, 576), 1 + 0.1 * _bf16(576, seed=1)
    assert torch.equal(elementwise.rms_norm(x, w, 1e-5), ne.native_rms_norm(x, w, 1e-5))
    gate, up = _bf16(4, 2 * 64).chunk(2, dim=-1)
    assert torch.equal(elementwise.silu_mul(gate, up), ne.native_silu_mul(gate, up))
    q, cos, sin = _bf16(2, 3, 4, 64), _bf16(2, 4, 64, seed=1), _bf16(2, 4, 64, seed=2)
    assert torch.equal(elementwise.rope(q, cos, sin), rope_torch(q, cos, sin))


def test_float32_and_other_layouts_keep_the_torch_ops():
    x, w = torch.randn(3, 576), torch.randn(576)
    assert ne.native_rms_norm(x, w, 1e-5) is None
    assert torch.equal(elementwise.rms_norm(x, w, 1e-5), rms_norm_torch(x, w, 1e-5))
    q = _bf16(2, 3, 4, 48)                                               # a head width not a multiple of 32
    assert ne.native_rope(q, _bf16(2, 4, 48), _bf16(2, 4, 48), head_dim=1) is None
    gate, up = _bf16(3, 8), _bf16(3, 8)
    scale = torch.rand(3)
    assert torch.equal(elementwise.silu_mul(gate, up, scale=scale), silu_mul_torch(gate, up, scale=scale))
    assert ne.native_silu_mul(gate, up.float()) is None


def test_kernels_that_fail_to_build_warn_once_and_the_torch_ops_run(monkeypatch):
    with failing_build(monkeypatch, ne._library):
        with pytest.warns(RuntimeWarning, match="native elementwise ops: the C kernel failed.*using torch ops"):
            assert ne._library() is None
        x, w = _bf16(2, 576), 1 + 0.1 * _bf16(576, seed=1)
        assert torch.equal(elementwise.rms_norm(x, w, 1e-5), rms_norm_torch(x, w, 1e-5))
        gate, up = _bf16(2, 64).chunk(2, dim=-1)
        assert torch.equal(elementwise.silu_mul(gate, up), F.silu(gate) * up)
