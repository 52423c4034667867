"""Group-wise 4-bit asymmetric quantization as paired pure functions (FlexGen section 5).

`quantize(x, config) -> QTensor` and `dequantize(q) -> Tensor` round-trip with an absolute error of at most
half a step per element: (max - min) / (2 * 15) of the element's group, plus rounding of min/scale to the
tensor's dtype. With `config.rotate` the bound holds in the rotated basis (each group times the normalized
Hadamard matrix H); since H is orthonormal, a group's L2 error is the same in both bases. Both run on
whatever device the input lives on: one fused Triton kernel for `quantize` on CUDA where it applies
(`engine.quant._quant_triton`, checked against the torch ops `quantize_torch` on a device's first call),
batched torch ops everywhere else.

Dequantization is two steps: `_affine_dequant` (codes -> mn + code * scale, the part a fused kernel may
replace) and, for rotated configs, `_unrotate` (a matmul by H over the last group dim).

The stored basis: `dequantize(q, unrotate=False)` stops after the affine step and returns the groups as
stored, [*lead, g*gs] (rotated when q.config.rotate, zero padding kept); `rotate_last` takes a dense tensor
into the same basis and `unrotate_last` takes it back. H is orthonormal per group, so dot products and
weighted sums along the last dim can be computed in the stored basis: q . k = rotate_last(q) . rotate_last(k),
and sum_i p_i v_i = unrotate_last(sum_i p_i rotate_last(v_i)). Decode attention over a rotated 4-bit cache
uses this to never un-rotate the cache's rows (engine.models.attention.chunked_decode_attention).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from engine.quant.config import QuantConfig
from engine.quant.kernels import affine_dequant
from engine.quant.qtensor import QTensor, scale_dtype
from engine.util.kernel_check import first_use_check

FUSED_GROUP_SIZES = (32, 64, 128)      # group sizes the fused quantize kernel takes (power-of-two tiles)
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=32)
def hadamard(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """Normalized Sylvester-Hadamard matrix [n, n] (n a power of two): symmetric, H @ H = I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)   # [2m, 2m]
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


def _stored_groups(x: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """x [*lead, d] -> [*lead, g, gs] float32 in the basis the groups are stored in: zero-padded to whole
    groups, each group times H when config.rotate."""
    *lead, d = x.shape
    gs = config.group_size
    groups = -(-d // gs)
    xf = x.float()
    if groups * gs != d:
        xf = F.pad(xf, (0, groups * gs - d))                               # pad with zeros to whole groups
    xf = xf.reshape(*lead, groups, gs)                                     # [*lead, g, gs]
    if config.rotate:
        xf = xf @ hadamard(gs, torch.float32, xf.device)                  # [*lead, g, gs] rotated basis
    return xf


def quantize(x: torch.Tensor, config: QuantConfig = QuantConfig()) -> QTensor:
    """x [*lead, d] float -> QTensor with groups of config.group_size along the last dim.

    CUDA tensors of float16/bfloat16/float32 with a group size in `FUSED_GROUP_SIZES`, Triton importable:
    one fused kernel (engine.quant._quant_triton; its codes may differ by one from the torch ops' where
    float32 summation order moves a value across a code boundary); everything else: the torch ops."""
    if x.is_cuda and x.dtype in _FUSED_DTYPES and config.group_size in FUSED_GROUP_SIZES \
            and _triton_ready(x.get_device(), x.dtype, config):
        from engine.quant import _quant_triton    # optional dependency: Triton, imported on CUDA only

        return _quant_triton.quantize_triton(x, config)
    return quantize_torch(x, config)


def quantize_torch(x: torch.Tensor, config: QuantConfig = QuantConfig()) -> QTensor:
    """`quantize` by batched torch ops on x's device (the reference the fused kernel is checked against)."""
    xf = _stored_groups(x, config)                                         # [*lead, g, gs] float32
    mn = xf.amin(dim=-1, keepdim=True)                                     # [*lead, g, 1]
    mx = xf.amax(dim=-1, keepdim=True)
    scale = (mx - mn) / config.levels
    mn_s, scale_s = mn.to(scale_dtype(x.dtype)), scale.to(scale_dtype(x.dtype))  # stored precision
    inv = torch.where(scale_s.float() > 0, 1.0 / scale_s.float(), torch.zeros_like(scale))
    codes = ((xf - mn_s.float()) * inv).round_().clamp_(0, config.levels).to(torch.uint8)  # [*lead, g, gs]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)                    # [*lead, g, gs/2]
    return QTensor(packed.contiguous(), mn_s.contiguous(), scale_s.contiguous(), torch.Size(x.shape), config,
                   x.dtype)


@functools.lru_cache(maxsize=None)
def _triton_ready(device_index: int, dtype: torch.dtype, config: QuantConfig) -> bool:
    """True when Triton imports and `_self_check` passes on cuda:device_index for `dtype` and `config`
    (checked once per device, dtype and config, so only the kernels in use compile; synchronizes that
    once). Otherwise warns once and the torch ops are used for them."""
    device = torch.device("cuda", device_index)
    return first_use_check("quantize", str(device), lambda: _self_check(device, dtype, config))


def _self_check(device: torch.device, dtype: torch.dtype, config: QuantConfig) -> bool:
    """The fused quantize on `device` (the CPU: Triton's interpreter) against `quantize_torch` on the CPU, by
    `quantize_mismatch`, on a small strided input with a padded last group; True, or RuntimeError saying
    what differs (ImportError without Triton)."""
    from engine.quant import _quant_triton    # optional dependency: Triton (absent: torch path)

    gen = torch.Generator(device="cpu").manual_seed(0)
    gs = config.group_size
    x = (torch.randn(2, 7, 3, gs + gs // 2 + 2, generator=gen) * 3).to(dtype).transpose(1, 2)   # [2, 3, 7, d]
    problem = quantize_mismatch(_quant_triton.quantize_triton(x.to(device), config), quantize_torch(x, config))
    if problem:
        raise RuntimeError(f"the Triton quantize kernel differs from the torch ops for {dtype}, {config}: {problem}")
    return True


def quantize_mismatch(got: QTensor, want: QTensor, max_code_share: float = 1e-3) -> str | None:
    """None when `got` matches `want` as the fused quantize must match the torch ops: the same layout,
    min/scale within one unit in the last place of their dtype (float32 ones of rotated groups: within the
    rotation's float32 summation error), codes off by at most one in at most `max_code_share` of the elements; else a sentence saying what differs. Compares on the CPU."""
    for name in ("data", "mn", "scale"):
        a, b = getattr(got, name), getattr(want, name)
        if a.shape != b.shape or a.dtype != b.dtype or not a.is_contiguous():
            return f"{name} is {a.dtype} {tuple(a.shape)}, want contiguous {b.dtype} {tuple(b.shape)}"
    if want.mn.dtype == torch.float32 and want.config.rotate:
        # float32 min/scale of rotated groups: within the float32 summation error of the rotation, gs * eps
        # times the group's magnitude (a few dozen ulps where the min is near zero)
        mn, scale = want.mn.cpu(), want.scale.cpu()
        tol = want.config.group_size * torch.finfo(torch.float32).eps * (mn.abs() + want.config.levels * scale)
        for name in ("mn", "scale"):
            err = (getattr(got, name).cpu() - getattr(want, name).cpu()).abs()
            if bool((err > tol).any()):
                return f"{name} differs by more than the rotation's float32 rounding (max {float(err.max()):.3g})"
    else:
        for name in ("mn", "scale"):
            ulps = _ulps(getattr(got, name).cpu(), getattr(want, name).cpu())
            if ulps.numel() and int(ulps.max()) > 1:
                return f"{name} differs by {int(ulps.max())} units in the last place"
    codes = [torch.stack((q.data.cpu() & 15, q.data.cpu() >> 4), -1).flatten(-2).to(torch.int16) for q in (got, want)]
    diff = (codes[0] - codes[1]).abs()
    if diff.numel() and (int(diff.max()) > 1 or float((diff > 0).float().mean()) > max_code_share):
        return f"codes differ: max {int(diff.max())}, in {float((diff > 0).float().mean()):.2%} of the elements"
    return None


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Units in the last place between same-shape float16/float32 tensors a and b (int64; -0 == +0)."""
    view, magnitude = (torch.int16, 0x7FFF) if a.dtype == torch.float16 else (torch.int32, 0x7FFFFFFF)
    keys = []
    for t in (a, b):
        bits = t.contiguous().view(view).to(torch.int64)
        keys.append(torch.where(bits < 0, -(bits & magnitude), bits))      # monotonic in the value
    return (keys[0] - keys[1]).abs()


def _affine_dequant(q: QTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Codes -> mn + code * scale: [*lead, g, gs] in q.dtype (still in the rotated basis if q.config.rotate),
    written into `out` ([*lead, g, gs] or [*lead, g*gs]) when given; one fused kernel on CUDA."""
    return affine_dequant(q.data, q.mn, q.scale, q.dtype, out=out)         # [*lead, g, gs]


def _unrotate(grouped: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """[*lead, g, gs] in the rotated basis -> original basis (times H, its own inverse), same dtype."""
    h = hadamard(config.group_size, grouped.dtype, grouped.device)        # [gs, gs]
    return grouped @ h                                                     # [*lead, g, gs]


def rotate_last(x: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """x [*lead, d] -> [*lead, g*gs] in the basis `quantize(x, config)` stores its groups in: zero-padded to
    whole groups, each group times H when config.rotate. Same dtype as x (the product is taken in float32)."""
    return _stored_groups(x, config).flatten(-2).to(x.dtype)              # [*lead, g*gs]


def unrotate_last(y: torch.Tensor, config: QuantConfig, d: int) -> torch.Tensor:
    """The inverse of `rotate_last`: y [*lead, g*gs] in the stored basis -> [*lead, d] (each group times H
    when config.rotate, the padding dropped). Same dtype as y (the product is taken in float32)."""
    gs = config.group_size
    yf = y.float().unflatten(-1, (y.shape[-1] // gs, gs))                  # [*lead, g, gs]
    if config.rotate:
        yf = _unrotate(yf, config)                                         # [*lead, g, gs] original basis
    return yf.flatten(-2)[..., :d].to(y.dtype)                             # [*lead, d]


def dequantize(q: QTensor, out: torch.Tensor | None = None, *, unrotate: bool = True) -> torch.Tensor:
    """QTensor -> dense tensor of q.shape in q.dtype on q.device (written into `out` when given).

    `unrotate=False`: the stored basis instead, [*lead, g*gs] (the groups as `quantize` stored them: rotated
    when q.config.rotate, zero padding kept), i.e. only the affine step; `out` then has that shape, or
    [*lead, g, gs], and is written directly (one fused kernel on CUDA)."""
    if not unrotate:
        return _affine_dequant(q, out=out).flatten(-2)                     # [*lead, g*gs]
    d = q.shape[-1]
    if out is not None and not q.config.rotate and d == 2 * q.data.shape[-2] * q.data.shape[-1]:
        _affine_dequant(q, out=out)                                        # no padding: straight into out
        return out
    dense = _affine_dequant(q)                                             # [*lead, g, gs]
    if q.config.rotate:
        dense = _unrotate(dense, q.config)
    dense = dense.flatten(-2)[..., :d]                                     # [*lead, d]
    if out is None:
        return dense
    return out.copy_(dense)
