"""Attention, in one room: the masks, the SDPA core, the cores over a KV cache and the attention layer.

Shapes: b batch, nh query heads, nkv kv heads, g = nh / nkv, s new tokens, t keys, L a shared prefix's
tokens, hd head_dim, h hidden.

Why here, in `models`: attention is model maths (a pure function of weights, hidden states and a kv view),
and the design forbids models -> runtime, while the runtime may import models. So the cores live here and
both the reference model path (`attention`, used by the parity tests) and the runtime use them: the
runtime's `KVHome` (engine.runtime.kv_cache) only decides *where* the cache segments live and calls
`prefill_attention` / `decode_attention` / `cpu_decode_attention` on them; the executor calls
`attention_layer` (decode) and `prefix_attention` / `suffix_attention` (prefill, through
`engine.runtime.prefill_chunks`) with its KV home and GPU batch (the `CacheAttention` and
`AttentionBatch` protocols below). The 4-bit cache is dequantized with `engine.quant` (pure maths); a rotated
4-bit cache (`QuantConfig.rotate`) only to its stored, rotated basis: decode attends there with a rotated
query and un-rotates the output once (`chunked_decode_attention`), never a cache row. On CUDA a 4-bit cache
is read packed by one fused kernel instead (`engine.models.quant_decode`, which falls back to these cores).

Decode uses grouped-query attention without repeating K/V: the g query heads of each kv head are laid out
as g "positions" of one query block (they all sit at the same position, so no causal mask is needed).
All cores run natively in the cache dtype (bf16/fp16 SDPA kernels), never upcasting the cache. Decode over a
bfloat16 cache on the CPU runs a C kernel of the engine's own instead of SDPA where it applies
(`engine.models.native_attention`).
`softcap` (Gemma2's attn_logit_softcapping) switches to the explicit soft-capped core; a sliding window is
part of the mask / key_valid the attention layer builds (`window_keep`).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.models.base import ModelFamily, Weights
from engine.models.config import ModelConfig
from engine.models.native_attention import native_decode_attention
from engine.quant.config import QuantConfig
from engine.quant.group import dequantize, rotate_last, unrotate_last
from engine.quant.qtensor import QTensor

# dense keys + values dequantized per chunk of host attention. On a 2-core CPU (Mixtral-8x7B's shape), in each
# of nine runs of benchmarks/kernels/cpu_attention_speed.py, 64 MiB is the slowest of 8, 16 and 64, by 3-50%. The
# likely cause, not measured apart: each of the two 32 MiB buffers sits at glibc's largest
# dynamic mmap threshold, so every chunk faults in fresh pages; 8 MiB buffers are reused from the heap.
CPU_CHUNK_BYTES = 16 << 20


def causal_mask(key_valid: torch.Tensor, s: int) -> torch.Tensor:
    """Attention mask for s new queries over t keys, the new ones last.

    key_valid [b, t] bool (False for left padding) -> mask [b, 1, s, t] bool, True = may attend. Query i
    (absolute key index t - s + i) sees valid keys at or before itself; it always sees itself, so a padding
    query's row is never all-False (its output is garbage the caller ignores, but never NaN)."""
    b, t = key_valid.shape
    q_idx = torch.arange(t - s, t, device=key_valid.device)[:, None]  # [s, 1]
    k_idx = torch.arange(t, device=key_valid.device)[None, :]  # [1, t]
    causal = k_idx <= q_idx  # [s, t]
    mask = causal[None] & key_valid[:, None, :]  # [b, s, t]
    mask = mask | (k_idx == q_idx)[None]  # [b, s, t]
    return mask[:, None]  # [b, 1, s, t]


def window_keep(key_valid: torch.Tensor, s: int, window: int) -> torch.Tensor:
    """Sliding-window attention's extra mask: key_valid [b, t] bool, the last s keys being the queries' own ->
    [b, 1, s, t] bool, True where the key is fewer than `window` positions before the query (transformers'
    `kv_idx > q_idx - sliding_window`). Positions count valid keys only (a row's left padding and the gap
    after a shared prefix are not positions), so it is exact for padded and prefix-sharing batches."""
    pos = key_valid.cumsum(-1) - 1  # [b, t]
    return (pos[:, None, :] > pos[:, -s:, None] - window)[:, None]  # [b, 1, s, t]


_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         scale: float, softcap: float) -> torch.Tensor:
    """Attention with Gemma2's logit soft-capping, as transformers' eager path computes it: scores = q k^T *
    scale, capped to softcap * tanh(scores / softcap), masked, softmax in float32, cast back, times v.
    q [b, nh, s, hd], k/v [b, nkv, t, hd] (nh a multiple of nkv), mask [b, 1, s, t] bool -> [b, nh, s, hd]."""
    b, nh, s, hd = q.shape
    nkv = k.shape[1]
    qg = q.reshape(b, nkv, (nh // nkv) * s, hd)  # [b, nkv, g*s, hd]: the g query heads of a kv head
    scores = torch.matmul(qg, k.transpose(2, 3)).view(b, nkv, nh // nkv, s, -1) * scale  # [b, nkv, g, s, t]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [b, nkv, g, s, t]
    out = torch.matmul(probs.view(b, nkv, -1, probs.shape[-1]), v)  # [b, nkv, g*s, hd]
    return out.view(b, nh, s, hd)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
         enable_gqa: bool = False, softcap: float | None = None) -> torch.Tensor:
    """F.scaled_dot_product_attention, never through cuDNN on a GPU: cuDNN's SDPA builds a new graph for
    every new key length, which costs 4.8 ms of host time per decode call on an H200 (measured with
    benchmarks/profiling/gpu_profile.py: 1229 ms of 256 calls), more than the whole layer's device time. With
    `softcap` (Gemma2) SDPA cannot apply the cap: `softcapped_attention` computes it."""
    if softcap is not None:
        return softcapped_attention(q, k, v, mask, scale, softcap)
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and mask is not None and mask.shape[1] == 1:
        return _folded_sdpa(q, k, v, mask, scale)
    with sdpa_kernel(_NO_CUDNN):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def _folded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Grouped-query SDPA with a mask on CUDA as plain SDPA: each kv head's g query heads folded into its
    query length, q [b, nh, s, hd] -> [b, nkv, g*s, hd], mask [b, 1, s, t] -> [b, 1, g*s, t] (the same maths:
    query head kv*g + j is kv head kv's j-th group). torch's fused kernels take no GQA with a mask, so unfolded
    it ran the math path (its score matrices and ~10 kernels per call). -> [b, nh, s, hd], laid out in memory
    as [b, s, nh, hd]: the one copy that unfolds the heads also makes the attention output's
    transpose(1, 2).reshape(b, s, nh * hd) a view (before, two copies of the whole output)."""
    b, nh, s, hd = q.shape
    nkv, t = k.shape[1], k.shape[2]
    g = nh // nkv
    qf = q.reshape(b, nkv, g * s, hd)                                          # [b, nkv, g*s, hd]
    mf = mask.unsqueeze(2).expand(mask.shape[0], 1, g, s, t).reshape(mask.shape[0], 1, g * s, t)  # [b, 1, g*s, t]
    with sdpa_kernel(_NO_CUDNN):
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mf, scale=scale)   # [b, nkv, g*s, hd]
    unfolded = torch.empty((b, s, nkv, g, hd), dtype=out.dtype, device=out.device)  # [b, s, nkv, g, hd]
    unfolded.copy_(out.reshape(b, nkv, g, s, hd).permute(0, 3, 1, 2, 4))       # (fused kernels return it strided)
    return unfolded.view(b, s, nh, hd).transpose(1, 2)                          # [b, nh, s, hd]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """The reference attention core.

    q [b, nh, s, hd], k/v [b, nkv, t, hd] (nh a multiple of nkv: grouped-query attention), mask broadcastable
    to [b, nh, s, t] (bool, True = attend; or additive float) or None for full attention -> [b, s, nh*hd].
    """
    b, nh, s, hd = q.shape
    out = sdpa(q, k, v, mask, scale, enable_gqa=k.shape[1] != nh, softcap=softcap)  # [b, nh, s, hd]
    return out.transpose(1, 2).reshape(b, s, nh * hd)  # [b, s, nh*hd]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float, softcap: float | None = None) -> torch.Tensor:
    """q [b, nh, s, hd], k/v [b, nkv, s, hd], mask [b, 1, s, s] bool (True = attend) -> [b, nh, s, hd]."""
    return sdpa(q, k, v, mask, scale, enable_gqa=k.shape[1] != q.shape[1], softcap=softcap)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
                     scale: float, softcap: float | None = None) -> torch.Tensor:
    """q [b, nh, 1, hd], k/v [b, nkv, t, hd] (the new token included), key_valid [b, t] bool -> [b, nh, 1, hd].
    A bfloat16 cache on the CPU takes the C kernel (`engine.models.native_attention`) where it applies."""
    if softcap is None and not q.is_cuda:
        out = native_decode_attention(q, k, v, key_valid, scale)
        if out is not None:
            return out
    b, nh, _, hd = q.shape
    nkv = k.shape[1]
    qg = q.reshape(b, nkv, nh // nkv, hd)                                   # [b, nkv, g, hd]
    mask = key_valid[:, None, None, :]                                      # [b, 1, 1, t]
    out = sdpa(qg, k, v, mask, scale, softcap=softcap)                      # [b, nkv, g, hd]
    return out.reshape(b, nh, 1, hd)


def stored_rotation(k: torch.Tensor | QTensor, v: torch.Tensor | QTensor) -> QuantConfig | None:
    """The config whose rotated basis decode attention runs in when k and v are both rotated 4-bit, else None
    (dense or unrotated 4-bit: dequantize and attend as stored)."""
    rotated = [x.config for x in (k, v) if isinstance(x, QTensor) and x.config.rotate]
    if len(rotated) == 2 and rotated[0] == rotated[1]:
        return rotated[0]
    return None


DenseKV = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]   # (r0, r1) -> k, v of rows [r0, r1)


def chunked_decode_attention(q: torch.Tensor, dense_kv: DenseKV, key_valid: torch.Tensor, scale: float, rows: int,
                             softcap: float | None = None, rotation: QuantConfig | None = None) -> torch.Tensor:
    """`decode_attention` of q [b, nh, 1, hd] over `dense_kv(r0, r1)` -> k, v [r1-r0, nkv, t, hd], `rows` rows
    at a time (the dense keys/values of one chunk live at once) -> [b, nh, 1, hd].

    With `rotation`, dense_kv gives k/v [r1-r0, nkv, t, G] in its stored basis (engine.quant.group: G = hd
    padded to whole groups, each group rotated by H; `dequantize(..., unrotate=False)` of a rotated 4-bit
    cache, new positions through `rotate_last`): q is rotated once, attention runs in that basis and the
    output is un-rotated once. H is orthonormal per group, so the scores (Hq).(Hk) = q.k and the weighted sum
    of the rotated values, un-rotated, is the attention output: no cached row is ever un-rotated."""
    b, _, _, hd = q.shape
    if rotation is not None:
        q = rotate_last(q, rotation)                                        # [b, nh, 1, G]
    if rows >= b:
        out = decode_attention(q, *dense_kv(0, b), key_valid, scale, softcap)
    else:
        out = torch.empty_like(q)                                           # [b, nh, 1, hd|G]
        for r0 in range(0, b, rows):
            r1 = min(b, r0 + rows)
            out[r0:r1] = decode_attention(q[r0:r1], *dense_kv(r0, r1), key_valid[r0:r1], scale, softcap)
    return out if rotation is None else unrotate_last(out, rotation, hd)   # [b, nh, 1, hd]


def dense_keys(x: torch.Tensor | QTensor, t: int, rotation: QuantConfig | None = None,
               prefix: torch.Tensor | None = None, new: torch.Tensor | QTensor | None = None) -> torch.Tensor:
    """Positions [0, t) of a cache tensor x [c, h, S, hd] dense, after a shared `prefix` [1, h, L, w] (the same
    for every row) and before `new` [c, h, 1, hd] (a decode step's key or value; a QTensor when x is 4-bit:
    the position as the cache will hold it): [c, h, L + t (+ 1), w]. w is hd, or with `rotation` (x a
    rotated 4-bit tensor) G, its stored basis (`prefix` already in it, `new` dequantized into it, or rotated
    when dense). Without a prefix or a new position a dense x is returned as a view; otherwise one fresh
    buffer is written part by part (4-bit parts dequantized straight into it, never concatenated)."""
    part = x[:, :, :t]
    if prefix is None and new is None:
        return dequantize(part, unrotate=rotation is None) if isinstance(part, QTensor) else part
    c, h, _, hd = x.shape
    width = hd if rotation is None else x.data.shape[-2] * rotation.group_size
    L = 0 if prefix is None else prefix.shape[2]
    device = (new if new is not None else prefix).device
    dense = torch.empty((c, h, L + t + (new is not None), width), dtype=x.dtype, device=device)  # [c, h, L+t(+1), w]
    if prefix is not None:
        dense[:, :, :L].copy_(prefix.expand(c, -1, -1, -1))
    if isinstance(part, QTensor):
        dequantize(part, out=dense[:, :, L:L + t], unrotate=rotation is None)
    else:
        dense[:, :, L:L + t].copy_(part)
    if isinstance(new, QTensor):
        dequantize(new, out=dense[:, :, L + t:], unrotate=rotation is None)
    elif new is not None:
        dense[:, :, L + t:].copy_(new if rotation is None else rotate_last(new, rotation))
    return dense


def cpu_decode_attention(q: torch.Tensor, k: torch.Tensor | QTensor, v: torch.Tensor | QTensor,
                         key_valid: torch.Tensor, scale: float, softcap: float | None = None,
                         chunk_bytes: int = CPU_CHUNK_BYTES,
                         prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`decode_attention` on host tensors, chunked over the batch so a compressed cache is dequantized
    one chunk (about `chunk_bytes` of dense keys+values) at a time; each chunk runs `decode_attention`
    (threads across rows and heads: the C kernel for bfloat16, torch's SDPA otherwise) in the cache's own
    dtype. A rotated 4-bit cache is only affine-dequantized and attended in its rotated basis
    (`chunked_decode_attention`). k/v may be memory-mapped (disk tier): pages are read as chunks are touched.
    `prefix`: a shared prefix's dense keys and values [1, nkv, L, hd] every row attends to in full before its
    own k/v (key_valid [b, L + t] covers both; its first L columns are all True, as `engine.runtime.batch`
    builds them: a row's padding sits after the prefix). benchmarks/kernels/cpu_attention_speed.py measures
    the chunk sizes."""
    b, nh, _, hd = q.shape
    nkv, t = k.shape[1], k.shape[2]
    L = 0 if prefix is None else prefix[0].shape[2]
    if prefix is not None and softcap is None and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        return prefix_split_attention(q, k, v, key_valid[:, L:], scale, *prefix)
    row_bytes = 2 * nkv * (L + t) * hd * q.element_size()
    chunk = max(1, min(b, chunk_bytes // max(1, row_bytes)))
    rotation = stored_rotation(k, v)
    pk, pv = (None, None) if prefix is None else (
        prefix if rotation is None else tuple(rotate_last(x, rotation) for x in prefix))

    return chunked_decode_attention(
        q, lambda r0, r1: (dense_keys(k[r0:r1], t, rotation, pk), dense_keys(v[r0:r1], t, rotation, pv)),
        key_valid, scale, chunk, softcap, rotation)


def prefix_split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor, scale: float,
                           pk: torch.Tensor, pv: torch.Tensor) -> torch.Tensor:
    """Host decode attention after a shared prefix every row attends to in full, without copying the prefix
    into each row's keys: q [b, nh, 1, hd] attends to the prefix pk/pv [1, nkv, L, hd] as one query sequence of
    all b x g rows per kv head (the prefix read once per layer) and to its own k/v [b, nkv, t, hd] (key_valid
    [b, t]) in place; the two softmax partials merge by their log-sum-exps (float32) -> [b, nh, 1, hd]. The same
    attention as over the concatenated keys, up to rounding; the copy it avoids would write L + t positions per row
    and layer, twice the bytes the attention itself reads."""
    b, nh, _, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qg = q.reshape(b, nkv, g, hd)                                                       # [b, nkv, g, hd]
    own_mask = torch.zeros(key_valid.shape, dtype=q.dtype).masked_fill_(~key_valid, float("-inf"))  # [b, t]
    own, own_lse = flash(qg, k, v, 0.0, False, attn_mask=own_mask[:, None, None, :], scale=scale)  # [b, nkv, g, hd|]
    shared, shared_lse = flash(qg.transpose(0, 1).reshape(1, nkv, b * g, hd), pk, pv, 0.0, False,
                               scale=scale)                                              # [1, nkv, b*g, hd|]
    shared = shared.view(nkv, b, g, hd).transpose(0, 1)                                  # [b, nkv, g, hd]
    shared_lse = shared_lse.view(nkv, b, g).transpose(0, 1)                              # [b, nkv, g]
    top = torch.maximum(own_lse, shared_lse)
    w_own, w_shared = (own_lse - top).exp_(), (shared_lse - top).exp_()                  # [b, nkv, g]
    out = (own.float() * w_own[..., None] + shared.float() * w_shared[..., None]) / (w_own + w_shared)[..., None]
    return out.to(q.dtype).view(b, nh, 1, hd)


class CacheAttention(Protocol):
    """The attention over one layer's KV cache for one GPU batch (the runtime's `KVHome`): it stores the new
    k/v and returns the attention output, wherever its segments live."""

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                scale: float, softcap: float | None = None) -> torch.Tensor: ...

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: int, key_valid: torch.Tensor,
               key_valid_host: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor: ...


class AttentionBatch(Protocol):
    """What the attention layer reads of a GPU batch (the runtime's `GpuBatch`)."""

    positions: torch.Tensor          # [b, s]
    prefix_positions: torch.Tensor   # [1, L]
    key_valid: torch.Tensor          # [b, S] bool on the device
    key_valid_host: torch.Tensor     # [b, S] bool on the host
    t: int                           # cache positions written so far

    @property
    def prefill(self) -> bool: ...


def attention_layer(c: ModelConfig, f: ModelFamily, w: Weights, kv: CacheAttention, batch: AttentionBatch,
                    layer: int, x: torch.Tensor) -> torch.Tensor:
    """Attention layer `layer` of a GPU batch: q/k/v from `f`, attention over `kv` (prefill: causal over the
    batch's valid keys; decode: the new token over the cache; both inside the layer's sliding window, if
    any, and soft-capped where the config says), then `f.attn_out` -> [b, s, h]."""
    s = x.shape[1]
    window, cap = c.layer_window(layer), c.attn_logit_softcapping
    if batch.prefill:
        q, k, v = f.attn_qkv(w, x, batch.positions, layer)                             # [b, nh|nkv, s, hd]
        mask = causal_mask(batch.key_valid[:, :s], s)                                  # [b, 1, s, s]
        if window is not None:
            mask = mask & window_keep(batch.key_valid[:, :s], s, window)
        out = kv.prefill(q, k, v, mask, c.attn_scale, cap)                             # [b, nh, s, hd]
    else:
        d = decode_inputs(c, f, w, batch, layer, x)
        out = kv.decode(d.q, d.k, d.v, d.t, d.valid, d.valid_host, c.attn_scale, cap)  # [b, nh, 1, hd]
    return attention_output(c, f, w, out, x)                                           # [b, s, h]


class DecodeInputs(NamedTuple):
    """What decode attention over a cache needs: the new token's q [b, nh, 1, hd] and k/v [b, nkv, 1, hd],
    its cache position t, and the keys it may see, key_valid [b, t+1] on the device and on the host (both
    inside the layer's sliding window, if any)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    t: int
    valid: torch.Tensor
    valid_host: torch.Tensor


def decode_inputs(c: ModelConfig, f: ModelFamily, w: Weights, batch: AttentionBatch, layer: int,
                  x: torch.Tensor) -> DecodeInputs:
    """The first half of a decode attention layer: q/k/v of the new token x [b, 1, h] and its key validity."""
    window = c.layer_window(layer)
    q, k, v = f.attn_qkv(w, x, batch.positions, layer)                                 # [b, nh|nkv, 1, hd]
    t = batch.t
    valid, valid_host = batch.key_valid[:, :t + 1], batch.key_valid_host[:, :t + 1]       # [b, t+1]
    if window is not None:
        valid = valid & window_keep(valid, 1, window)[:, 0, 0]
        valid_host = valid_host & window_keep(valid_host, 1, window)[:, 0, 0]
    return DecodeInputs(q, k, v, t, valid, valid_host)


def attention_output(c: ModelConfig, f: ModelFamily, w: Weights, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The last half of an attention layer: the cores' output [b, nh, s, hd] through `f.attn_out` with the
    residual x [b, s, h] -> [b, s, h]."""
    b, s, _ = x.shape
    attn = out.transpose(1, 2).reshape(b, s, c.num_attention_heads * c.head_dim)       # [b, s, nh*hd]
    return f.attn_out(w, attn, x)                                                      # [b, s, h]


def prefix_attention(c: ModelConfig, f: ModelFamily, w: Weights, batch: AttentionBatch, layer: int,
                     px: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A shared prefix [1, L] attending causally to itself, once for the batch -> (its layer output [1, L, h],
    its keys, its values [1, nkv, L, hd]) for `suffix_attention`."""
    L = px.shape[1]
    window, cap = c.layer_window(layer), c.attn_logit_softcapping
    pq, pk, pv = f.attn_qkv(w, px, batch.prefix_positions, layer)                      # [1, nh|nkv, L, hd]
    ones = torch.ones(1, L, dtype=torch.bool, device=px.device)
    pmask = causal_mask(ones, L)                                                       # [1, 1, L, L]
    if window is not None:
        pmask = pmask & window_keep(ones, L, window)
    pout = prefill_attention(pq, pk, pv, pmask, c.attn_scale, cap)                     # [1, nh, L, hd]
    return f.attn_out(w, pout.transpose(1, 2).reshape(1, L, -1), px), pk, pv           # [1, L, h]


def suffix_attention(c: ModelConfig, f: ModelFamily, w: Weights, kv: CacheAttention, batch: AttentionBatch,
                     layer: int, pk: torch.Tensor, pv: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The suffixes x [b, s, h] of a prefix-sharing batch: they attend to the prefix's keys pk/pv [1, nkv, L, hd]
    (broadcast) and causally to their own; the cache gets prefix + suffix keys -> [b, s, h]."""
    L, (b, s, _) = pk.shape[2], x.shape
    window, cap = c.layer_window(layer), c.attn_logit_softcapping
    q, k, v = f.attn_qkv(w, x, batch.positions, layer)                                 # [b, nh|nkv, s, hd]
    k = torch.cat((pk.expand(b, -1, -1, -1), k), dim=2)                                # [b, nkv, L+s, hd]
    v = torch.cat((pv.expand(b, -1, -1, -1), v), dim=2)
    own = causal_mask(batch.key_valid[:, L:L + s], s)                                  # [b, 1, s, s]
    mask = torch.cat((own.new_ones(b, 1, s, L), own), dim=-1)                          # [b, 1, s, L+s]
    if window is not None:
        mask = mask & window_keep(batch.key_valid[:, :L + s], s, window)
    out = kv.prefill(q, k, v, mask, c.attn_scale, cap)                                 # [b, nh, s, hd]
    attn = out.transpose(1, 2).reshape(b, s, c.num_attention_heads * c.head_dim)       # [b, s, nh*hd]
    return f.attn_out(w, attn, x)                                                      # [b, s, h]
