"""`quantized_decode_attention`: decode attention read straight from a 4-bit cache, one fused kernel on CUDA.

The chunked path (`engine.models.attention.chunked_decode_attention`) dequantizes a chunk of rows' keys and
values into a dense buffer and runs SDPA on it: several launches per chunk, and chunks of ~20 rows at
256 MiB. On an H200 with OPT-30B at 192 rows (4-bit cache, 84% of it loaded from the host every step) that
is about 1 s of the compute thread's time per decode step, more than the step's 0.93 s transfer floor, so
the device waits for the host (`engine.runtime.step_clock`: `lead_s` ~0 in the slow steps). The fused kernel
(`engine.models._quant_decode_triton`) reads the packed cache, dequantizes in registers exactly as
`affine_dequant` does, and runs an online softmax over the 4-bit positions: one launch for every row and head
(under grouped-query attention a program takes a kv head's whole group, so each key is read once for it), no
dense copy of the cache. With it the same run's compute thread spends 0.24 s a step and the mean step is
0.997 s, 1.07x the floor. A shared prefix is every row's: its part of the softmax comes first, from two batched
float32 GEMMs per kv head over all rows (`prefix_state`), and the kernel continues from that state.

Values: the keys and values are the chunked path's bit for bit; the softmax and the weighted sum run in
float32 in another order than SDPA's, so outputs differ from it within float rounding. Every device-side
4-bit segment takes this kernel where it applies, so the placements of one cache agree with each other.

`quantized_decode_attention` returns None where the kernel does not apply (not CUDA, Triton absent or its
first-use check failed, a dtype or layout it does not take); the caller then takes the chunked path.
"""
from __future__ import annotations

import functools

import torch

from engine.models.attention import chunked_decode_attention, dense_keys
from engine.quant.config import QuantConfig
from engine.quant.group import quantize, rotate_last, unrotate_last
from engine.quant.qtensor import QTensor
from engine.util.kernel_check import first_use_check

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the float32 workspace of a chunk of rows' `prefix_state`: at most the chunked path's dense keys and values
# (`engine.policy.working.DECODE_CHUNK_BYTES`), which `working_bytes` counts whichever path runs
PREFIX_STATE_BYTES = 256 << 20


def _parts(x: QTensor, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(data, mn, scale) of positions [0, t) of a [b, h, S, d] QTensor in the kernel's layout, else None."""
    data, mn, scale = (p[:, :, :t] for p in x.parts())
    half = data.shape[-1]
    if data.stride(-1) != 1 or data.stride(-2) != half or mn.stride() != scale.stride() or mn.stride(-2) != 1:
        return None
    return data, mn, scale


def _applies(q: torch.Tensor, k: QTensor, v: QTensor, prefix: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    if not (q.is_cuda and q.dtype in _DTYPES and k.dtype == v.dtype == q.dtype and k.device == q.device):
        return False
    if len(k.shape) != 4 or k.config != v.config or q.stride(-1) != 1:
        return False
    if prefix is not None and any(p.stride(-1) != 1 or p.dtype != q.dtype for p in prefix):
        return False
    return _triton_ready(q.get_device())


def quantized_decode_attention(q: torch.Tensor, k: QTensor, v: QTensor, t: int, key_valid: torch.Tensor,
                               scale: float, softcap: float | None = None, rotation: QuantConfig | None = None,
                               prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """Decode attention of q [b, nh, 1, hd] over a shared dense `prefix` (k, v [1, nkv, L, w], in `rotation`'s
    stored basis when given) then positions [0, t) of the 4-bit k/v [b, nkv, S, hd] (the new token's already
    written), key_valid [b, L + t] bool -> [b, nh, 1, hd]; None where the fused kernel does not apply.
    `rotation` (`attention.stored_rotation(k, v)`): attend in the rotated basis the cache is stored in, q
    rotated once and the output un-rotated once; a rotated cache without it (keys to be un-rotated row by
    row) is not the kernel's."""
    if (k.config.rotate and rotation != k.config) or not _applies(q, k, v, prefix):
        return None
    kp, vp = _parts(k, t), _parts(v, t)
    if kp is None or vp is None:
        return None
    return fused(q, kp, vp, t, key_valid, scale, softcap, rotation, prefix)


def fused(q: torch.Tensor, k_parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
          v_parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], t: int, key_valid: torch.Tensor, scale: float,
          softcap: float | None, rotation: QuantConfig | None,
          prefix: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The kernel's launch with no checks (`_parts` layouts; the first-use check and the interpreter tests call
    it directly): q rotated into the stored basis and the output rotated back when `rotation` is given. With a
    prefix, rows go `prefix_rows` at a time: each chunk's prefix state (`prefix_state`), then the kernel from it."""
    from engine.models import _quant_decode_triton    # optional dependency: Triton, imported on CUDA only

    hd = q.shape[-1]
    qb = rotate_last(q, rotation) if rotation is not None else q                 # [b, nh, 1, hd|G]
    qb = qb if qb.stride(-1) == 1 else qb.contiguous()
    width, key_valid = qb.shape[-1], key_valid.contiguous()
    if prefix is None:
        out = _quant_decode_triton.quant_decode_triton(qb, k_parts, v_parts, t, width, key_valid, scale, softcap,
                                                       None)                      # [b, nh, 1, hd|G]
    else:
        b, L = qb.shape[0], prefix[0].shape[2]
        rows = prefix_rows(qb.shape[1], width, L)
        pk, pv = (x[0].float() for x in prefix)                                    # [nkv, L, hd|G] once a call
        parts = []
        for r0 in range(0, b, rows):
            r1 = min(b, r0 + rows)
            valid = key_valid[r0:r1]
            state = prefix_state(qb[r0:r1], pk, pv, valid[:, :L], scale, softcap)
            parts.append(_quant_decode_triton.quant_decode_triton(
                qb[r0:r1], tuple(x[r0:r1] for x in k_parts), tuple(x[r0:r1] for x in v_parts), t, width,
                valid[:, L:], scale, softcap, state))                            # [r1 - r0, nh, 1, hd|G]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out if rotation is None else unrotate_last(out, rotation, hd)       # [b, nh, 1, hd]


def prefix_rows(num_heads: int, width: int, prefix_len: int) -> int:
    """Rows whose `prefix_state` workspace fits `PREFIX_STATE_BYTES` (at least one): per row and query head, float32
    queries, scores (the probabilities in their place) and weighted sums, as computed and as returned."""
    return max(1, PREFIX_STATE_BYTES // (4 * num_heads * (3 * width + prefix_len)))


def prefix_state(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, valid: torch.Tensor, scale: float,
                 softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The online softmax's state after a shared prefix every row attends to, for the kernel to continue from:
    q [c, nh, 1, W] over pk/pv with valid [c, L] -> (m [c, nh], l [c, nh], acc [c, nh, W])
    float32, contiguous: each query head's largest (scaled, soft-capped) score, its sum of exp(score - m) and
    the values' sum weighted by those (m -inf, l and acc 0 where a row's prefix keys are all masked). pk/pv:
    the prefix's keys and values [nkv, L, W] in float32. Per kv head the c x g queries meet the prefix's keys in
    two batched float32 GEMMs: the prefix is read once, not once per row as a program of the kernel would."""
    c, nh, _, w = q.shape
    nkv, L = pk.shape[0], pk.shape[1]
    g = nh // nkv
    qg = q.reshape(c, nkv, g, w).permute(1, 0, 2, 3).reshape(nkv, c * g, w).float()   # [nkv, c*g, W]
    s = torch.bmm(qg, pk.transpose(1, 2)).mul_(scale)                                   # [nkv, c*g, L]
    if softcap is not None:
        s.div_(softcap).tanh_().mul_(softcap)
    s.view(nkv, c, g, L).masked_fill_(~valid[None, :, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)                                                    # [nkv, c*g, 1]
    p = s.sub_(torch.where(m == float("-inf"), 0.0, m)).exp_()                          # [nkv, c*g, L]
    l = p.sum(dim=-1)                                                                   # [nkv, c*g]
    acc = torch.bmm(p, pv)                                                              # [nkv, c*g, W]

    def by_row(x: torch.Tensor) -> torch.Tensor:
        """[nkv, c*g, ...] -> [c, nh, ...] contiguous (head kvh * g + i)."""
        return x.reshape(nkv, c, g, *x.shape[2:]).transpose(0, 1).reshape(c, nh, *x.shape[2:]).contiguous()
    return by_row(m[..., 0]), by_row(l), by_row(acc)


def _reference(q: torch.Tensor, k: QTensor, v: QTensor, t: int, key_valid: torch.Tensor, scale: float,
               softcap: float | None, prefix: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The chunked path's answer (one chunk), for the first-use check."""
    rotation = k.config if k.config.rotate else None
    pk, pv = prefix if prefix is not None else (None, None)
    return chunked_decode_attention(q, lambda r0, r1: (dense_keys(k[r0:r1], t, rotation, pk),
                                                       dense_keys(v[r0:r1], t, rotation, pv)),
                                    key_valid, scale, q.shape[0], softcap, rotation)


def self_check(device: torch.device) -> bool:
    """The kernel against the chunked path on small inputs on `device` (grouped-query heads, a prefix, a
    masked key, soft-capping, a rotated cache, fp16 and fp32); raises RuntimeError naming the case on a
    mismatch (compiles the kernel; synchronizes)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    for dtype, rotate, softcap, with_prefix in ((torch.float16, False, None, True), (torch.float32, True, 30.0, False),
                                                (torch.bfloat16, True, None, False)):
        cfg = QuantConfig(group_size=32, rotate=rotate)
        b, nkv, g, S, hd, t, L = 3, 2, 2, 40, 48, 37, 5
        q = torch.randn(b, nkv * g, 1, hd, generator=gen).to(device, dtype)
        k = quantize(torch.randn(b, nkv, S, hd, generator=gen).to(device, dtype), cfg)
        v = quantize(torch.randn(b, nkv, S, hd, generator=gen).to(device, dtype), cfg)
        prefix = None
        if with_prefix:
            prefix = tuple(torch.randn(1, nkv, L, hd, generator=gen).to(device, dtype) for _ in range(2))
        valid = torch.ones(b, (L if with_prefix else 0) + t, dtype=torch.bool, device=device)
        valid[1, :3] = False
        got = fused(q, _parts(k, t), _parts(v, t), t, valid, hd ** -0.5, softcap, cfg if rotate else None, prefix)
        want = _reference(q, k, v, t, valid, hd ** -0.5, softcap, prefix)
        tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}[dtype]     # about one ulp of 1
        if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
            err = (got.float() - want.float()).abs().max().item()
            raise RuntimeError(f"the fused 4-bit decode kernel differs from the chunked path for {dtype}, "
                               f"rotate={rotate}, softcap={softcap}, prefix={with_prefix}: max error {err:.3g}")
    return True


@functools.lru_cache(maxsize=None)
def _triton_ready(device_index: int) -> bool:
    """True when Triton imports and the kernel matches the chunked path on cuda:device_index (checked once
    per device; synchronizes that once). Otherwise warns once (a failed check) and the chunked path is used."""
    return first_use_check("quantized_decode_attention", f"cuda:{device_index}",
                           lambda: self_check(torch.device("cuda", device_index)))
