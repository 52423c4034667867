"""Group-wise 4-bit quantization: round-trip error bounds, layout, padding, slicing."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.quant import QuantConfig, dequantize, empty_qtensor, qtensor_nbytes, quantize


def _half_step(x: torch.Tensor, gs: int) -> torch.Tensor:
    d = x.shape[-1]
    pad = (-d) % gs
    g = F.pad(x.float(), (0, pad)).reshape(*x.shape[:-1], -1, gs)
    step = (g.amax(-1) - g.amin(-1)) / 15                                       # [*lead, g]
    return step.repeat_interleave(gs, dim=-1)[..., :d] / 2                      # [*lead, d]


@pytest.mark.parametrize("dtype,slack", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("shape", [(7, 128), (3, 2, 5, 64), (4, 100), (2, 16)])
def test_round_trip_within_half_step(dtype, slack, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype)
    q = quantize(x, QuantConfig())
    y = dequantize(q)
    assert y.shape == x.shape and y.dtype == dtype
    err = (y.float() - x.float()).abs()
    bound = _half_step(x, 64) * (1 + slack) + slack * x.float().abs().amax()
    assert bool((err <= bound).all()), float((err - bound).max())


def test_layout_and_size():
    x = torch.randn(6, 130)
    q = quantize(x, QuantConfig(group_size=64))
    assert q.data.dtype == torch.uint8 and q.data.shape == (6, 3, 32)           # 130 -> 3 groups of 64
    assert q.mn.shape == (6, 3, 1) and q.scale.shape == (6, 3, 1)
    assert q.nbytes == qtensor_nbytes((6, 130), torch.float32, QuantConfig())
    assert q.nbytes < x.numel() * 4 / 3


def test_constant_groups_are_exact():
    x = torch.full((2, 64), 1.5)
    assert torch.equal(dequantize(quantize(x)), x)


def test_leading_dim_indexing_and_copy():
    torch.manual_seed(1)
    x = torch.randn(4, 3, 10, 64)
    q = quantize(x)
    dst = empty_qtensor((4, 3, 10, 64), torch.float32, QuantConfig())
    dst[:, :, 2:5].copy_(q[:, :, 2:5])
    assert torch.equal(dequantize(dst[:, :, 2:5]), dequantize(q)[:, :, 2:5])
    kept = q.index_select(0, torch.tensor([0, 2]))
    assert torch.equal(dequantize(kept), dequantize(q)[[0, 2]])
    with pytest.raises(IndexError):
        q[0, 0, 0, 0]


def test_quantized_matmul_close():
    torch.manual_seed(2)
    w = torch.randn(256, 512) * 0.02
    x = torch.randn(8, 512)
    ref = x @ w.T
    got = x @ dequantize(quantize(w)).T
    rel = (got - ref).norm() / ref.norm()
    assert rel < 0.1


def test_bad_config():
    with pytest.raises(ValueError, match="4-bit"):
        QuantConfig(bits=3)
    with pytest.raises(ValueError, match="even"):
        QuantConfig(group_size=63)
