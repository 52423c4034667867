"""The fused quantize (`engine.quant._quant_triton`) against the torch ops (`quantize_torch`): the same
layout, min/scale within one ulp (float32 rotated: the rotation's float32 rounding), codes off by at most
one in under 0.1% of the elements, dequantized values within one quantization step. In Triton's CPU
interpreter where Triton is installed, on CUDA where there is a GPU; the CPU dispatch stays the torch ops."""
from __future__ import annotations

import pytest
import torch

from engine.quant import QuantConfig, quantize
from engine.quant.config import CACHE_QUANT
from engine.quant.group import FUSED_GROUP_SIZES, quantize_mismatch, quantize_torch
from engine.quant.qtensor import QTensor
from helpers.quant_checks import check_against_torch, random_input
from helpers.skips import requires_cuda
from helpers.triton_kernels import assert_self_check_passes, run_interpreted

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def test_cpu_dispatch_is_the_torch_ops():
    x = random_input((3, 5, 100), torch.float16)
    for config in (QuantConfig(), CACHE_QUANT):
        got, want = quantize(x, config), quantize_torch(x, config)
        assert all(torch.equal(a, b) for a, b in zip(got.parts(), want.parts()))


def test_mismatch_names_what_differs():
    q = quantize_torch(random_input((4, 8, 128), torch.float16), CACHE_QUANT)
    assert quantize_mismatch(q, q) is None
    bumped = q.data.clone()
    bumped.view(-1)[0] = (bumped.view(-1)[0] & 0xF0) | (((bumped.view(-1)[0] & 15) + 2) % 16)   # a code off by 2
    assert "codes differ: max 2" in quantize_mismatch(QTensor(bumped, q.mn, q.scale, q.shape, q.config, q.dtype), q)
    ones = q.data.clone()
    ones.view(-1)[:8] ^= 1                                                          # 16 codes off by one of 4096
    assert "codes differ" in quantize_mismatch(QTensor(ones, q.mn, q.scale, q.shape, q.config, q.dtype), q)
    mn = q.mn.clone()
    mn.view(-1)[3] = mn.view(-1)[3] * (1 + 2 ** -8)                                 # ~4 ulps of float16
    assert "mn differs" in quantize_mismatch(QTensor(q.data, mn, q.scale, q.shape, q.config, q.dtype), q)
    assert "scale is" in quantize_mismatch(QTensor(q.data, q.mn, q.scale.float(), q.shape, q.config, q.dtype), q)


_INTERPRETED = """
import torch
from engine.quant import QuantConfig
from engine.quant._quant_triton import quantize_triton
from engine.quant.group import _self_check
from helpers.quant_checks import check_against_torch, random_input

shapes = [((1, 1, 1, 200), None), ((3, 7, 5, 96), (1, 2)), ((2, 1, 3, 1, 2, 2, 64), None),
          ((2, 3, 2, 3, 2, 32), (0, 4)), ((4, 0, 64), None), ((5, 130), None)]
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    for gs in (32, 64, 128):
        for rotate in (False, True):
            config = QuantConfig(group_size=gs, rotate=rotate)
            for i, (shape, swap) in enumerate(shapes):
                x = random_input(shape, dtype, seed=i)
                x = x.transpose(*swap) if swap else x          # strided lead dims (5 after merging: copied)
                check_against_torch(quantize_triton(x, config), x, config)
            assert _self_check(torch.device("cpu"), dtype, config)     # the first-call check's body
"""


def test_fused_quantize_in_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_INTERPRETED)


@pytest.mark.parametrize("xdt, sdt", [("*bf16", "*fp16"), ("*fp32", "*fp32")])
def test_kernel_compiles_for_sm90(xdt, sdt):
    """The GPU compile on the CPU; the rounding step survives as written (no FMA, the 1.5 * 2^23 add)."""
    pytest.importorskip("triton")
    import triton.language as tl

    from engine.quant._quant_triton import _WARPS, _quantize_kernel, launch_block
    from helpers.triton_kernels import compile_for_sm90

    sig = {"x_ptr": xdt, "data_ptr": "*u8", "mn_ptr": sdt, "scale_ptr": sdt, "n_groups": "i64", "groups": "i32",
           "d": "i32", "size1": "i32", "size2": "i32", "size3": "i32", "stride0": "i64", "stride1": "i64",
           "stride2": "i64", "stride3": "i64", "inv_sqrt": "fp32", "GS": "constexpr", "LEVELS": "constexpr",
           "ROTATE": "constexpr", "SCALE": "constexpr", "BLOCK_G": "constexpr"}
    for gs, rotate in ((64, True), (128, False)):
        ptx = compile_for_sm90(_quantize_kernel, sig, {"GS": gs, "LEVELS": 15, "ROTATE": rotate,
                                                       "SCALE": tl.float16 if sdt == "*fp16" else tl.float32,
                                                       "BLOCK_G": launch_block(gs)}, num_warps=_WARPS,
                               enable_fp_fusion=False)
        assert "0f4B400000" in ptx and "div.rn.f32" in ptx
        assert ("fma.rn.f32" in ptx) == rotate                                  # only the rotation's dot


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gs", FUSED_GROUP_SIZES)
@pytest.mark.parametrize("rotate", [False, True])
def test_fused_quantize_on_cuda(dtype, gs, rotate):
    pytest.importorskip("triton")
    from engine.quant._quant_triton import quantize_triton

    config = QuantConfig(group_size=gs, rotate=rotate)
    cases = [((1, 1, 1, 200), None), ((3, 7, 33, 96), (1, 2)), ((2, 1, 3, 1, 2, 2, 64), None),
             ((2, 3, 4, 5, 6, 32), (0, 4)), ((4, 0, 64), None), ((1000, 130), None), ((81, 8, 50, 128), (1, 2))]
    for i, (shape, swap) in enumerate(cases):
        x = random_input(shape, dtype, seed=i).cuda()
        x = x.transpose(*swap) if swap else x
        got = quantize_triton(x, config)
        check_against_torch(got, x, config)
        via = quantize(x, config)                                                    # the dispatch takes the kernel
        assert all(torch.equal(a, b) for a, b in zip(via.parts(), got.parts()))


@requires_cuda
@pytest.mark.parametrize("shape", [(81, 8, 50, 128), (48, 56, 1, 128), (48, 8, 1, 128)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_quantize_cache_shapes_on_cuda(shape, dtype):
    """The Llama-3-70B prefill chunk's new keys ([b, nkv, s, hd] from a transposed projection) and a decode
    step's, with the cache's config, against the torch ops on the GPU itself."""
    pytest.importorskip("triton")
    from engine.quant import _quant_triton

    b, nkv, s, hd = shape
    x = random_input((b, s, nkv, hd), dtype, seed=7).cuda().transpose(1, 2)                  # [b, nkv, s, hd] strided
    got = _quant_triton.quantize_triton(x, CACHE_QUANT)
    assert quantize_mismatch(got, quantize_torch(x, CACHE_QUANT)) is None


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [CACHE_QUANT, QuantConfig(group_size=32), QuantConfig(group_size=128, rotate=True)])
def test_first_call_self_check_passes_on_cuda(dtype, config):
    pytest.importorskip("triton")
    from engine.quant import group

    assert_self_check_passes(group._triton_ready, dtype, config)
