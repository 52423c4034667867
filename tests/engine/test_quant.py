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


@pytest.mark.parametrize("n", [2, 32, 64, 128])
def test_hadamard_is_symmetric_orthonormal_involution(n):
    from engine.quant.group import hadamard

    h = hadamard(n)
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h, torch.eye(n), atol=1e-6)
    assert torch.allclose(h.abs(), torch.full((n, n), n ** -0.5))
    with pytest.raises(ValueError, match="power of two"):
        hadamard(48)


@pytest.mark.parametrize("gs", [32, 64])
@pytest.mark.parametrize("shape", [(3, 2, 5, 64), (4, 100)])
def test_rotated_round_trip_within_half_step_in_rotated_basis(gs, shape):
    from engine.quant.group import hadamard

    torch.manual_seed(3)
    x = torch.randn(shape) * 3
    x[..., 5] *= 30                                                              # an outlier channel
    cfg = QuantConfig(group_size=gs, rotate=True)
    y = dequantize(quantize(x, cfg))
    assert y.shape == x.shape and y.dtype == x.dtype
    h = hadamard(gs)
    pad = (-shape[-1]) % gs

    def rotated(t):                                                              # [*lead, g, gs] in H basis
        return F.pad(t, (0, pad)).reshape(*shape[:-1], -1, gs) @ h

    xr, yr = rotated(x), rotated(y)
    err = (yr - xr).abs().reshape(*shape[:-1], -1)
    bound = _half_step(xr.reshape(*shape[:-1], -1), gs) * (1 + 1e-5) + 1e-4
    assert bool((err <= bound).all()), float((err - bound).max())
    plain = dequantize(quantize(x, QuantConfig(group_size=gs)))
    assert (y - x).norm() < 0.6 * (plain - x).norm()                             # rotation tames the outlier


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotated_round_trip_half_dtypes(dtype):
    torch.manual_seed(4)
    x = torch.randn(6, 4, 64).to(dtype)
    y = dequantize(quantize(x, QuantConfig(rotate=True)))
    assert y.dtype == dtype
    rel = (y.float() - x.float()).norm() / x.float().norm()
    assert rel < 0.12


def test_rotated_slicing_and_out():
    torch.manual_seed(5)
    cfg = QuantConfig(group_size=32, rotate=True)
    x = torch.randn(4, 3, 10, 64)
    q = quantize(x, cfg)
    dst = empty_qtensor((4, 3, 10, 64), torch.float32, cfg)
    dst[:, :, 2:5].copy_(q[:, :, 2:5])
    assert torch.equal(dequantize(dst[:, :, 2:5]), dequantize(q)[:, :, 2:5])
    out = torch.empty(4, 3, 10, 64)
    assert dequantize(q, out=out) is out and torch.equal(out, dequantize(q))
    assert q.nbytes == quantize(x, QuantConfig(group_size=32)).nbytes              # rotation costs no bytes


def test_rotate_config_validation_and_tag():
    with pytest.raises(ValueError, match="power-of-two"):
        QuantConfig(group_size=48, rotate=True)
    assert QuantConfig(group_size=48).tag == "q4g48"
    assert QuantConfig(group_size=32, rotate=True).tag == "q4g32r"
    assert QuantConfig(rotate=True) != QuantConfig()


@pytest.mark.parametrize("dtype,stored", [(torch.float16, torch.float16), (torch.bfloat16, torch.float16),
                                          (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)])
def test_host_affine_step_gives_the_half_arithmetic_bits(dtype, stored):
    """The host's float32 affine step equals torch's own mn + code * scale in the scales' dtype, bit for bit, over
    scales and minima across the half range (subnormal to large), written fresh or into `out`."""
    from engine.quant.affine_torch import affine_dequant_torch

    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (3, 40, 2, 32), dtype=torch.uint8, generator=gen)
    exp = torch.randint(-14, 12, (3, 40, 2, 1), generator=gen).float()
    mn = (torch.randn(3, 40, 2, 1, generator=gen) * 2.0 ** exp).to(stored)
    scale = (torch.rand(3, 40, 2, 1, generator=gen) * 2.0 ** (exp - 3)).to(stored)
    codes = torch.stack((data & 0x0F, data >> 4), dim=-1).flatten(-2).to(stored)      # [3, 40, 2, 64]
    want = torch.addcmul(mn, codes, scale).to(dtype)
    assert torch.equal(affine_dequant_torch(data, mn, scale, dtype), want)
    out = torch.empty(3, 40, 128, dtype=dtype)
    affine_dequant_torch(data, mn, scale, dtype, out=out)
    assert torch.equal(out, want.flatten(-2))


def test_host_affine_step_in_blocks_of_a_large_stacked_tensor(monkeypatch):
    """A stacked tensor whose one leading row is larger than a block, and a strided `out` (a slice of positions of
    a larger buffer): the blocked host path still gives torch's half arithmetic bit for bit."""
    from engine.quant import affine_torch

    monkeypatch.setattr(affine_torch, "_HOST_BLOCK", 4096)
    gen = torch.Generator().manual_seed(5)
    data = torch.randint(0, 256, (2, 3, 70, 2, 32), dtype=torch.uint8, generator=gen)     # row 0: 26,880 codes
    mn = torch.randn(2, 3, 70, 2, 1, generator=gen).half()
    scale = torch.rand(2, 3, 70, 2, 1, generator=gen).half()
    codes = torch.stack((data & 0x0F, data >> 4), dim=-1).flatten(-2).half()
    want = torch.addcmul(mn, codes, scale).to(torch.bfloat16).flatten(-2)                 # [2, 3, 70, 128]
    big = torch.zeros(2, 3, 90, 128, dtype=torch.bfloat16)
    affine_torch.affine_dequant_torch(data, mn, scale, torch.bfloat16, out=big[:, :, 10:80])
    assert torch.equal(big[:, :, 10:80], want)
    assert not big[:, :, :10].any() and not big[:, :, 80:].any()
