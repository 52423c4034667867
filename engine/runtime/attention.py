"""Attention cores over the KV cache (pure functions). Shapes: b batch, nh query heads, nkv kv heads,
g = nh / nkv, s new tokens, t keys, hd head_dim.

Decode uses grouped-query attention without repeating K/V: the g query heads of each kv head are laid out
as g "positions" of one query block (they all sit at the same position, so no causal mask is needed).
All cores run natively in the cache dtype (bf16/fp16 SDPA kernels), never upcasting the cache.
`softcap` (Gemma2's attn_logit_softcapping) switches to the explicit soft-capped core (layers.sdpa); a sliding
window is part of the mask / key_valid the caller builds.
"""
from __future__ import annotations

import torch

from engine.models.layers import sdpa
from engine.quant.group import dequantize
from engine.quant.qtensor import QTensor

_CPU_CHUNK_BYTES = 64 << 20


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float, softcap: float | None = None) -> torch.Tensor:
    """q [b, nh, s, hd], k/v [b, nkv, s, hd], mask [b, 1, s, s] bool (True = attend) -> [b, nh, s, hd]."""
    return sdpa(q, k, v, mask, scale, enable_gqa=k.shape[1] != q.shape[1], softcap=softcap)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
                     scale: float, softcap: float | None = None) -> torch.Tensor:
    """q [b, nh, 1, hd], k/v [b, nkv, t, hd] (the new token included), key_valid [b, t] bool -> [b, nh, 1, hd]."""
    b, nh, _, hd = q.shape
    nkv = k.shape[1]
    qg = q.reshape(b, nkv, nh // nkv, hd)                                   # [b, nkv, g, hd]
    mask = key_valid[:, None, None, :]                                      # [b, 1, 1, t]
    out = sdpa(qg, k, v, mask, scale, softcap=softcap)                      # [b, nkv, g, hd]
    return out.reshape(b, nh, 1, hd)


def cpu_decode_attention(q: torch.Tensor, k: torch.Tensor | QTensor, v: torch.Tensor | QTensor,
                         key_valid: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
    """`decode_attention` on host tensors, chunked over the batch so a compressed cache is dequantized
    one chunk (~64 MiB of keys+values) at a time; each chunk runs torch's multi-threaded SDPA kernel in
    the cache's own dtype. k/v may be memory-mapped (disk tier): pages are read as chunks are touched."""
    b, nh, _, hd = q.shape
    nkv, t = k.shape[1], k.shape[2]
    row_bytes = 2 * nkv * t * hd * q.element_size()
    chunk = max(1, min(b, _CPU_CHUNK_BYTES // max(1, row_bytes)))
    if chunk >= b and not isinstance(k, QTensor):
        return decode_attention(q, k, v, key_valid, scale, softcap)
    out = torch.empty_like(q)                                               # [b, nh, 1, hd]
    for r0 in range(0, b, chunk):
        r1 = min(b, r0 + chunk)
        kc = dequantize(k[r0:r1]) if isinstance(k, QTensor) else k[r0:r1]  # [c, nkv, t, hd]
        vc = dequantize(v[r0:r1]) if isinstance(v, QTensor) else v[r0:r1]
        out[r0:r1] = decode_attention(q[r0:r1], kc, vc, key_valid[r0:r1], scale, softcap)
    return out
