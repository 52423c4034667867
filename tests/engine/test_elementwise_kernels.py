"""`engine.models.elementwise`: RMSNorm and silu(gate) * up. Off CUDA the torch ops (Hugging Face's formulas); the
fused Triton kernels (in Triton's CPU interpreter where Triton is installed, on CUDA where there is a GPU)
within one ulp of them where the second factor is 1 and within two ulps, one for at least 99.9% of the
elements, otherwise (the module docstring says why); float32 within 2^-20."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.elementwise import (close_to_torch, rms_norm, rms_norm_torch, rope, rope_torch, silu_mul,
                                       silu_mul_torch)
from engine.models.layers import apply_rope, gated_activation
from helpers.elementwise_checks import check_close
from helpers.skips import requires_cuda
from helpers.triton_kernels import assert_self_check_passes, run_interpreted

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def test_rms_norm_off_cuda_is_the_hugging_face_formula():
    torch.manual_seed(0)
    for dtype in DTYPES:
        x, w = torch.randn(3, 5, 64).to(dtype), torch.randn(64).to(dtype)
        xf = x.float()
        want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        assert torch.equal(rms_norm(x, w, 1e-6), want) and torch.equal(rms_norm_torch(x, w, 1e-6), want)


def test_rope_off_cuda_is_the_hugging_face_formula():
    torch.manual_seed(0)
    for dtype in DTYPES:
        x = torch.randn(2, 3, 5, 8).to(dtype)                                     # [b, n, s, hd]
        cos, sin = torch.randn(2, 5, 8).to(dtype), torch.randn(2, 5, 8).to(dtype)
        rotated = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
        want = x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
        assert torch.equal(apply_rope(x, cos, sin), want) and torch.equal(rope(x, cos, sin), want)
        assert torch.equal(rope_torch(x, cos, sin), want)


def test_gated_activation_fuses_silu_only():
    torch.manual_seed(0)
    gate, up = torch.randn(4, 32).chunk(2, dim=-1)
    assert gated_activation("silu") is silu_mul and gated_activation("swish") is silu_mul
    assert torch.equal(silu_mul(gate, up), F.silu(gate) * up)
    gelu = gated_activation("gelu_pytorch_tanh")
    assert torch.equal(gelu(gate, up), F.gelu(gate, approximate="tanh") * up)
    with pytest.raises(ValueError, match="unsupported activation 'nope'"):
        gated_activation("nope")


def test_silu_mul_writes_into_out_and_in_place():
    """out=gate computes in place (the routed experts' one pass, `moe._gate_up`) and another out receives the
    product; both equal the product silu_mul returns."""
    torch.manual_seed(1)
    gate, up = torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    want = F.silu(gate) * up
    other = torch.empty_like(gate)
    assert silu_mul(gate, up, out=other) is other and torch.equal(other, want)
    assert silu_mul(gate, up, out=gate) is gate and torch.equal(gate, want)


def test_silu_mul_scales_each_row_by_its_float32_weight():
    """scale [*lead] float32 multiplies each row of the product (a routed expert's routing weight, folded into
    the SiLU pass by `moe.experts_grouped_mm`), rounded as `.mul_(scale[..., None])` does; in place too."""
    torch.manual_seed(3)
    gate, up = torch.randn(3, 5, 16).bfloat16(), torch.randn(3, 5, 16).bfloat16()
    scale = torch.rand(3, 5)
    want = (F.silu(gate) * up).mul_(scale[..., None])
    assert want.dtype == torch.bfloat16 and not torch.equal(want, F.silu(gate) * up)
    assert torch.equal(silu_mul(gate, up, scale=scale), want)
    inplace = gate.clone()
    assert silu_mul(inplace, up, out=inplace, scale=scale) is inplace and torch.equal(inplace, want)


def test_close_to_torch_counts_ulps():
    want = torch.tensor([1.0, -2.0, 1e-3], dtype=torch.float16)
    one_up = torch.nextafter(want.float(), torch.tensor(9.0)).to(torch.float16)     # float16 rounds up to next
    eps = torch.finfo(torch.float16).eps
    two_up = (want.float() + torch.tensor([2 * eps, 4 * eps, 2 * eps * 2 ** -10])).to(torch.float16)
    assert close_to_torch(want, want) and close_to_torch(one_up, want)
    assert not close_to_torch(two_up, want) and close_to_torch(two_up, want, ulps=2)
    assert not close_to_torch(want.float(), want)                                    # dtype differs


_INTERPRETED = """
import torch
from engine.models._elementwise_triton import rms_norm_triton, rope_triton, silu_mul_triton
from engine.models.elementwise import _self_check, rms_norm_torch, rope_torch, silu_mul_torch
from helpers.elementwise_checks import check_close

torch.manual_seed(0)
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    for shape in ((1, 1, 4096), (12, 1000), (2, 3, 300), (5,), (3, 0, 64)):
        h = shape[-1]
        both = (torch.randn(*shape[:-1], 2 * h) * 2).to(dtype)         # [*lead, 2h]: gate and up halves
        gate, up = both.chunk(2, dim=-1)
        check_close(silu_mul_triton(gate, up), silu_mul_torch(gate, up), exact_factor=False)
        scale = 2.0 ** -torch.randint(0, 4, shape[:-1]).float()          # exact row scales: a row's ulps stay
        check_close(silu_mul_triton(gate, up, scale=scale), silu_mul_torch(gate, up, scale=scale),
                    exact_factor=False)
        for w, exact in ((torch.ones(h, dtype=dtype), True), ((1 + 0.3 * torch.randn(h)).to(dtype), False)):
            check_close(rms_norm_triton(gate, w, 1e-5), rms_norm_torch(gate, w, 1e-5), exact)
    q = torch.randn(2, 5, 4, 64).to(dtype).transpose(1, 2)              # [b, nh, s, hd] per-head norm (Qwen3)
    w = (1 + 0.3 * torch.randn(64)).to(dtype)
    check_close(rms_norm_triton(q, w, 1e-6), rms_norm_torch(q, w, 1e-6), exact_factor=False)
    for (b, n, s, hd) in ((2, 5, 3, 64), (1, 8, 1, 128), (3, 2, 4, 6), (1, 3, 0, 8)):   # RoPE: bit for bit
        qkv = (torch.randn(b, s, 3 * n * hd) * 4).to(dtype)
        x = qkv[..., n * hd:2 * n * hd].view(b, s, n, hd).transpose(1, 2)  # strided, as q/k of one projection
        cos, sin = (torch.randn(b, s, hd).to(dtype) for _ in range(2))
        got = rope_triton(x, cos, sin)
        assert got.is_contiguous() and torch.equal(got, rope_torch(x, cos, sin)), (dtype, b, n, s, hd)
        assert torch.equal(rope_triton(x, cos[:1], sin[:1]), rope_torch(x, cos[:1], sin[:1]))  # broadcast
    assert _self_check(torch.device("cpu"), dtype)                       # the first-call check's body
"""


def test_fused_kernels_in_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_INTERPRETED)


@pytest.mark.parametrize("xdt", ["*fp16", "*bf16", "*fp32"])
def test_kernels_compile_for_sm90(xdt):
    pytest.importorskip("triton")
    import triton.language as tl

    from engine.models._elementwise_triton import _norm_warps, _rms_norm_kernel, _silu_mul_kernel
    from helpers.triton_kernels import compile_for_sm90

    out = {"*fp16": tl.float16, "*bf16": tl.bfloat16, "*fp32": tl.float32}[xdt]
    sig = {"x_ptr": xdt, "w_ptr": xdt, "out_ptr": xdt, "n_rows": "i32", "n_cols": "i32", "x_row": "i64",
           "eps": "fp32", "ROWS": "constexpr", "BLOCK": "constexpr", "OUT": "constexpr"}
    for block, rows in ((16384, 1), (8192, 1), (128, 32)):
        ptx = compile_for_sm90(_rms_norm_kernel, sig, {"ROWS": rows, "BLOCK": block, "OUT": out},
                               num_warps=_norm_warps(block), enable_fp_fusion=False)
        assert "rsqrt" in ptx and "fma.rn" not in ptx
    sig = {"gate_ptr": xdt, "up_ptr": xdt, "scale_ptr": "*fp32", "out_ptr": xdt, "n_cols": "i32", "gate_row": "i64",
           "up_row": "i64", "OUT": "constexpr", "BLOCK": "constexpr", "SCALED": "constexpr"}
    for scaled in (False, True):
        ptx = compile_for_sm90(_silu_mul_kernel, sig, {"OUT": out, "BLOCK": 1024, "SCALED": scaled},
                               enable_fp_fusion=False)
        assert "ex2.approx" in ptx and "div.rn.f32" in ptx and "fma.rn" not in ptx
    from engine.models._elementwise_triton import _ROPE_HEADS, _rope_kernel

    sig = {"x_ptr": xdt, "cos_ptr": xdt, "sin_ptr": xdt, "out_ptr": xdt, **{k: "i64" for k in (
        "S", "N", "x_b", "x_n", "x_s", "c_b", "c_s", "s_b", "s_s")},
           "HALF": "constexpr", "HEADS": "constexpr", "BLOCK": "constexpr", "OUT": "constexpr"}
    ptx = compile_for_sm90(_rope_kernel, sig, {"HALF": 64, "HEADS": _ROPE_HEADS, "BLOCK": 128, "OUT": out},
                           enable_fp_fusion=False)
    assert "fma.rn" not in ptx                                   # each product rounds, as torch's ops do


CUDA_SHAPES = [(1, 1, 8192), (4096, 8192), (3, 17, 1000), (2, 3, 300), (1, 129), (5,), (7, 16384)]


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CUDA_SHAPES)
def test_rms_norm_kernel_on_cuda(dtype, shape):
    pytest.importorskip("triton")
    from engine.models._elementwise_triton import rms_norm_triton

    torch.manual_seed(1)
    x = (torch.randn(*shape[:-1], 2 * shape[-1], device="cuda") * 2).to(dtype)[..., :shape[-1]]   # row stride 2h
    for w, exact in ((torch.ones(shape[-1], dtype=dtype, device="cuda"), True),
                     ((1 + 0.3 * torch.randn(shape[-1], device="cuda")).to(dtype), False)):
        got = rms_norm_triton(x, w, 1e-5)
        check_close(got, rms_norm_torch(x, w, 1e-5), exact)                       # torch on the GPU
        check_close(got.cpu(), rms_norm_torch(x.cpu(), w.cpu(), 1e-5), exact)      # and on the CPU
        assert torch.equal(rms_norm(x, w, 1e-5), got)                              # the dispatch takes the kernel


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CUDA_SHAPES + [(4096, 28672)])
def test_silu_mul_kernel_on_cuda(dtype, shape):
    pytest.importorskip("triton")
    from engine.models._elementwise_triton import silu_mul_triton

    torch.manual_seed(2)
    gate, up = (torch.randn(*shape[:-1], 2 * shape[-1], device="cuda") * 3).to(dtype).chunk(2, dim=-1)
    got = silu_mul_triton(gate, up)
    check_close(got, silu_mul_torch(gate, up), exact_factor=False)
    assert torch.equal(silu_mul(gate, up), got)
    scale = 2.0 ** -torch.randint(0, 4, shape[:-1], device="cuda").float()              # exact row scales
    scaled = silu_mul(gate, up, scale=scale)
    check_close(scaled, silu_mul_torch(gate, up, scale=scale), exact_factor=False)
    assert torch.equal(scaled, got.float().mul(scale.unsqueeze(-1)).to(dtype))           # the same rounded product
    inplace = gate.clone()                       # (gate.contiguous() is gate itself where the leading dims are 1)
    assert silu_mul(inplace, up, out=inplace) is inplace and torch.equal(inplace, got)   # one pass, in place


@requires_cuda
def test_mixed_dtypes_take_the_torch_ops_on_cuda():
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, device="cuda")                                             # float32 weight: promotes
    assert rms_norm(x, w, 1e-6).dtype == torch.float32
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_first_call_self_check_passes_on_cuda(dtype):
    pytest.importorskip("triton")
    from engine.models import elementwise

    assert_self_check_passes(elementwise._triton_ready, dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(81, 64, 50, 128), (1536, 8, 1, 128), (1, 64, 150, 128), (3, 5, 7, 64)])
def test_rope_kernel_on_cuda_matches_torch_bit_for_bit(dtype, shape):
    pytest.importorskip("triton")
    from engine.models._elementwise_triton import rope_triton

    torch.manual_seed(3)
    b, n, s, hd = shape
    qkv = (torch.randn(b, s, (n + 2) * hd, device="cuda") * 4).to(dtype)
    x = qkv[..., :n * hd].view(b, s, n, hd).transpose(1, 2)                   # [b, n, s, hd], strided
    cos, sin = (torch.randn(b, s, hd, device="cuda").to(dtype) for _ in range(2))
    got = rope_triton(x, cos, sin)
    assert got.is_contiguous()
    assert torch.equal(got, rope_torch(x, cos, sin))                          # torch on the GPU
    assert torch.equal(got.cpu(), rope_torch(x.cpu(), cos.cpu(), sin.cpu()))  # and on the CPU
    assert torch.equal(rope(x, cos, sin), got)                                # the dispatch takes the kernel
