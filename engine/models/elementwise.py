"""The decoder layers' elementwise work: RMSNorm, SwiGLU's silu(gate) * up and RoPE's rotation.

Three paths, the same contract:
  - CUDA tensors with Triton importable: one fused Triton kernel each (`engine.models._elementwise_triton`),
    one read of the inputs and one write of the result instead of torch's ~7 passes over a float32 copy
    (RMSNorm), 3 passes (silu, product) or 5 (RoPE: two products, a negation, a concatenation, a sum; its
    output is contiguous, where torch's keeps the strided layout of q/k split from one projection and
    attention then copies it). Triton is imported on the first such call only (`engine` imports
    without Triton); that call checks the kernels against the torch ops on small inputs (one synchronize)
    and, on a mismatch, warns and keeps the torch ops (per device and dtype).
Values: RoPE's kernel rounds each product and the sum as torch does and matches it bit for bit. The other
kernels round where torch rounds (the normalized row, silu(gate), to the dtype, then the product
with the weight / up), so they differ only where float32 statistics summed in another order or Triton's
exp/rsqrt move that intermediate across a rounding boundary: one unit in the last place (ulp) of the
intermediate, which the second product can turn into two ulps of the result when the other factor is not
a power of two (weights of exactly 1, as dummy and freshly initialized models have: at most one ulp).
  - bfloat16 CPU tensors on a CPU with AVX512-BF16 and a C compiler: one C kernel each
    (`engine.models.native_elementwise`, built at first use; the same rounding as the Triton kernels, RoPE bit
    for bit).
  - everywhere else (and for layouts or dtypes the kernels do not take): the torch ops
    (`engine.models.elementwise_torch`), exactly as Hugging Face computes them.
All ops are asynchronous on CUDA (enqueued on the current stream), synchronous on the CPU.
"""
from __future__ import annotations

import functools

import torch

from engine.models.elementwise_torch import close_to_torch, rms_norm_torch, rope_torch, silu_mul_torch
from engine.models.native_elementwise import native_rms_norm, native_rope, native_silu_mul
from engine.util.kernel_check import first_use_check

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_NORM_WIDTH = 16384       # widest row the fused RMSNorm takes (a whole row per program, in registers)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face Llama computes it: statistics in float32, weight applied in x's dtype.
    x [*lead, h], weight [h] -> [*lead, h]; one fused kernel on CUDA when weight has x's dtype, one C kernel on
    a bfloat16 CPU tensor where it applies."""
    if not x.is_cuda:
        out = native_rms_norm(x, weight, eps)
        return rms_norm_torch(x, weight, eps) if out is None else out
    if (x.is_cuda and x.dtype in _FUSED_DTYPES and weight.dtype == x.dtype and weight.device == x.device
            and weight.dim() == 1 and weight.is_contiguous() and 0 < x.shape[-1] == weight.shape[0] <= MAX_NORM_WIDTH
            and _triton_ready(x.get_device(), x.dtype)):
        from engine.models import _elementwise_triton    # optional dependency: Triton, imported on CUDA only

        return _elementwise_triton.rms_norm_triton(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int = 1) -> torch.Tensor:
    """RoPE's rotation x * cos + rotate_half(x) * sin (Hugging Face Llama's half-split layout): x [b, n, s, hd]
    (`head_dim` 2: [b, s, n, hd], the layout q and k leave one projection in), cos/sin [b or 1, s, hd] -> x's
    layout; one fused kernel on CUDA (contiguous output) when cos/sin have x's dtype and width, one C kernel
    on bfloat16 CPU tensors where it applies (the same bits as the torch ops)."""
    if not x.is_cuda:
        out = native_rope(x, cos, sin, head_dim)
        return rope_torch(x, cos, sin, head_dim) if out is None else out
    if (head_dim == 1 and x.dtype in _FUSED_DTYPES and x.dim() == 4 and cos.dim() == 3 and sin.shape == cos.shape
            and cos.dtype == sin.dtype == x.dtype and cos.device == sin.device == x.device
            and x.shape[-1] == cos.shape[-1] and x.shape[-1] % 2 == 0 and cos.shape[1] == x.shape[2]
            and cos.shape[0] in (1, x.shape[0]) and x.stride(-1) == 1 and cos.stride(-1) == sin.stride(-1) == 1
            and _triton_ready(x.get_device(), x.dtype)):
        from engine.models import _elementwise_triton    # optional dependency: Triton, imported on CUDA only

        return _elementwise_triton.rope_triton(x, cos, sin)
    return rope_torch(x, cos, sin, head_dim)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None,
             scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.silu(gate) * up (SwiGLU's gated activation) in the inputs' dtype: gate, up [*lead, n] -> [*lead, n];
    one fused kernel on CUDA when both have one shape and dtype. `out` (gate itself, for one pass in place)
    receives the result when given: a contiguous tensor of gate's shape and dtype. `scale` [*lead] float32
    (a routed expert's routing weight per row) multiplies each row of the product, in float32 then rounded to
    the dtype, as `.mul_(scale[..., None])` does. Without `out` and `scale`, one C kernel on bfloat16 CPU tensors
    where it applies."""
    if out is None and scale is None and not gate.is_cuda:
        fused = native_silu_mul(gate, up)
        if fused is not None:
            return fused
    fits = out is None or (out.is_contiguous() and out.shape == gate.shape and out.dtype == gate.dtype)
    scaled = scale is None or (scale.dtype == torch.float32 and scale.shape == gate.shape[:-1]
                               and scale.is_contiguous() and scale.device == gate.device)
    if (gate.is_cuda and gate.dtype in _FUSED_DTYPES and up.dtype == gate.dtype and up.shape == gate.shape
            and up.device == gate.device and gate.dim() >= 1 and fits and scaled
            and _triton_ready(gate.get_device(), gate.dtype)):
        from engine.models import _elementwise_triton    # optional dependency: Triton, imported on CUDA only

        return _elementwise_triton.silu_mul_triton(gate, up, out, scale)
    return silu_mul_torch(gate, up, out, scale)


@functools.lru_cache(maxsize=None)
def _triton_ready(device_index: int, dtype: torch.dtype) -> bool:
    """True when Triton imports and `_self_check` passes on cuda:device_index for `dtype` (checked once per
    device and dtype; synchronizes that once). Otherwise warns once and the torch ops are used for that
    dtype."""
    device = torch.device("cuda", device_index)
    return first_use_check("engine.models.elementwise", str(device), lambda: _self_check(device, dtype))


def _self_check(device: torch.device, dtype: torch.dtype) -> bool:
    """The kernels on `device` (the CPU: Triton's interpreter) against the torch ops on the CPU, within two
    units in the last place (`close_to_torch`; the module docstring says why two; RoPE exactly), on small
    strided inputs;
    True, or RuntimeError naming the kernel (ImportError without Triton)."""
    from engine.models import _elementwise_triton    # optional dependency: Triton (absent: torch path)

    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, 5, 2 * 300, generator=gen).to(dtype)[..., :300]                  # row stride 600
    w = (1 + 0.1 * torch.randn(300, generator=gen)).to(dtype)
    q = torch.randn(2, 7, 3, 2 * 64, generator=gen).to(dtype)[..., :64].transpose(1, 2)     # [2, 3, 7, 64] strided
    cos, sin = (torch.randn(2, 7, 64, generator=gen).to(dtype) for _ in range(2))
    scale = 2.0 ** -torch.randint(0, 4, (3, 5), generator=gen).float()   # row scales, exact: two ulps still
    cases = (("rms_norm", _elementwise_triton.rms_norm_triton(x.to(device), w.to(device), 1e-5),
              rms_norm_torch(x, w, 1e-5), 2),
             ("silu_mul", _elementwise_triton.silu_mul_triton(*x.to(device).chunk(2, dim=-1)),
              silu_mul_torch(*x.chunk(2, dim=-1)), 2),
             ("scaled silu_mul", _elementwise_triton.silu_mul_triton(*x.to(device).chunk(2, dim=-1),
                                                                     scale=scale.to(device)),
              silu_mul_torch(*x.chunk(2, dim=-1), scale=scale), 2),
             ("rope", _elementwise_triton.rope_triton(q.to(device), cos.to(device), sin.to(device)),
              rope_torch(q, cos, sin), 0))
    for name, got, want, ulps in cases:
        if not (torch.equal(got.cpu(), want) if ulps == 0 else close_to_torch(got.cpu(), want, ulps=ulps)):
            raise RuntimeError(f"the Triton {name} kernel differs from the torch ops for {dtype}")
    return True
