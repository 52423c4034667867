"""The KV cache of one attention layer for one GPU batch: its homes on the tiers, and where attention runs.

The attention maths itself (masks, the SDPA cores over dense or 4-bit segments) is `engine.models.attention`;
a `KVHome` is that module's `CacheAttention`: it picks the device for each segment and calls the cores.

The cache [b, nkv, S, hd] (S = padded prompt + max new tokens) is cut along kv heads into segments by the
policy's cache fractions (`split_ranges`); each segment's keys/values live on one tier, dense or 4-bit
(`QTensor`, groups along hd). Attention per segment runs where the policy says:
  - gpu home: written in place, attention on the compute device;
  - cpu/disk home, decode, cpu_attention: the new q/k/v go to the host, attention runs there, only the
    output comes back (`decode`: in the calling thread; `decode_start`: on the `HostAttention` thread, joined
    later by the MoE pipeline, `engine.runtime.moe_schedule`);
  - cpu/disk home otherwise: `load` copies the home's written positions (`KVHome.written`, [0, t - L) before
    the decode at t: a pitched copy, `engine.storage.pitched`) into a device buffer before compute (the
    executor overlaps it with the previous GPU batch), attention runs on the device over those and the new
    position, and `store` writes the new positions back to the home after compute.
Stores never block the compute thread: the new positions go to a pinned staging buffer (the home's slice is
strided; one buffer per prefill row chunk, `KVHome.rows`) and a worker thread copies them into the home
(`Transfers.submit_host`). Decode over a 4-bit segment on the device reads it packed in one fused kernel
(`engine.models.quant_decode`: CUDA with Triton; a loaded segment's device copy gets the new position
first), else dequantizes it in chunks of rows (`engine.policy.working.decode_chunk_rows`), so its dense
keys/values never span the whole batch; a rotated 4-bit segment is attended in its rotated basis either
way (`chunked_decode_attention`, the new k/v quantized into it), never un-rotated row by row. The memory
model still counts the chunked path's dense chunk, which the fused kernel does not allocate. A home waits
for its own stores before it is read or compacted (`settle`); a staging buffer waits for its previous store
before it is reused (`StagingClaims`, `engine.runtime.kv_buffers`).
A 4-bit segment that `load` copies (a cpu/disk home without cpu_attention) is held positions-major: its home,
the device buffer it loads into, its relay and its staging buffers are memory [b, S, h, ...] seen as
[b, h, S, ...] (`_positions_major`), so the written positions of a row are one run of h times the bytes of a
head's: at prompt 77 and gen 128 a head's 4-bit codes run ~9 KB, which an H100's link moves at 89-93% of a
whole tensor's rate, a row's ~72 KB at 99% (`benchmarks/records/h100/link_speed.jsonl`). The fused kernel
reads either layout by its strides.
On a machine without a GPU the cpu tier is the compute memory, so "loading" a dense cpu home is aliasing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.models.attention import (chunked_decode_attention, cpu_decode_attention, decode_attention, dense_keys,
                                     prefill_attention, stored_rotation)
from engine.models.quant_decode import quantized_decode_attention
from engine.policy.placement import split_ranges
from engine.policy.working import DECODE_CHUNK_BYTES, decode_chunk_rows
from engine.quant.config import QuantConfig
from engine.quant.group import quantize, rotate_last
from engine.quant.qtensor import QTensor
from engine.runtime.arena import Arena
from engine.runtime.host_attention import HostAttention, HostJob
from engine.runtime.kv_buffers import BufferReleases, StagingClaims, address
from engine.runtime.transfers import Pending, Transfers
from engine.storage.copy import copy
from engine.storage.tiers import Stored, Tier

_ALL = slice(None)


@dataclass
class KVSegment:
    tier: Tier
    h0: int
    h1: int
    k: Stored                     # [b, h1-h0, S, hd]
    v: Stored
    buf: tuple[Stored, Stored] | None = None     # loaded device copy for this compute (dense or QTensor)
    staged: list = field(default_factory=list)   # (k_new, v_new, t0, r0) waiting for `store`
    parked: str | None = None                    # a gpu segment held on the host: its device key (`unpark`)
    buf_slot: int = 0                            # the `kvbuf` slot `buf` was loaded into
    positions_major: bool = False                # memory [b, S, h, ...] (`_positions_major`)


def _positions_major(x: Stored) -> Stored:
    """x [b, h, s, ...] with the same values in memory [b, s, h, ...] (a copy unless it already is)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _write(dst: Stored, src: torch.Tensor, t0: int, quant: QuantConfig | None, r0: int = 0) -> None:
    """dst[r0:r0+b, :, t0:t0+s] = src [b, h, s, hd] (quantized first when dst is a QTensor and src is not)."""
    index = (slice(r0, r0 + src.shape[0]), _ALL, slice(t0, t0 + src.shape[2]))
    if isinstance(dst, QTensor):
        dst[index].copy_(src if isinstance(src, QTensor) else quantize(src, quant))
    else:
        dst[index].copy_(src)


class KVHome:
    """Owner of the cache homes of (layer j, GPU batch k). `rows` shrinks on `compact`.

    `length` is the batch's cache positions S; with a shared prefix of `prefix_len` L (the batch's
    `GpuBatch.prefix_len` where `engine.policy.prefix.prefix_held_once` says, else 0: then the prefix's
    positions are the rows' own) the prefix's keys/values are held once for the batch, dense on the compute device
    (`prefix`, [1, nkv, L, hd]; a host copy of a host segment's heads for host attention), and the homes hold
    each row's own positions only: cache position x lives at home position x - L. Attention sees the prefix
    before the row's own keys, so its results are those of a cache holding the prefix in every row, with
    the prefix's keys exactly as the prefill computed them (dense, never quantized).

    Segment n's buffers are named `{key}.s{n}` in the arena on the gpu, `{host_key}.s{n}` (default `key`) on the
    other tiers. With `park_key` (a block whose prefill runs ahead, `engine.runtime.ahead`: the running block
    still holds the device cache) the gpu segments are parked on the host as `{park_key}.s{n}`, so their prefill
    writes are stored there like a host segment's, and a shared prefix is held in `{park_key}.prefix` on the
    device (the running block's is `{key}.prefix`); `unpark` moves them to `key`'s device homes before the first
    decode."""

    def __init__(self, arena: Arena, key: str, *, rows: int, length: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, cache_gpu: float, cache_cpu: float, quant: QuantConfig | None,
                 cpu_attention: bool, decode_chunk_bytes: int = DECODE_CHUNK_BYTES, prefix_len: int = 0,
                 host_key: str | None = None, park_key: str | None = None,
                 releases: BufferReleases | None = None):
        if not 0 <= prefix_len < length:
            raise ValueError(f"KVHome {key}: prefix_len {prefix_len} must be in [0, length {length})")
        self.arena, self.key, self.rows, self.length = arena, key, rows, length
        self.num_kv_heads, self.head_dim, self.decode_chunk_bytes = num_kv_heads, head_dim, decode_chunk_bytes
        self.dtype, self.quant, self.cpu_attention = dtype, quant, cpu_attention
        self.device = arena.device
        self.releases = releases if self.device.type == "cuda" else None
        self.prefix_len = prefix_len
        self.prefix: tuple[torch.Tensor, torch.Tensor] | None = None
        self._parked_prefix = prefix_len > 0 and park_key is not None
        if prefix_len:
            shape, name = (1, num_kv_heads, prefix_len, head_dim), park_key if self._parked_prefix else key
            self.prefix = (arena.get(f"{name}.prefix.k", Tier.GPU, shape, dtype),
                           arena.get(f"{name}.prefix.v", Tier.GPU, shape, dtype))
        self._prefix_parts: dict[tuple[int, bool, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        self.pending: list[Pending] = []            # this home's stores not yet complete on the host
        self.written = 0                            # home positions [0, written) hold keys/values
        self.segments: list[KVSegment] = []
        for n, (placed, h0, h1) in enumerate(split_ranges(num_kv_heads, cache_gpu, cache_cpu)):
            tier = Tier(placed)
            shape = (rows, h1 - h0, length - prefix_len, head_dim)
            parked = park_key is not None and tier is Tier.GPU
            name = f"{park_key}.s{n}" if parked else f"{key if tier is Tier.GPU else host_key or key}.s{n}"
            where = Tier.CPU if parked else tier
            major = quant is not None and not parked and tier is not Tier.GPU and not cpu_attention
            k = self._buffer(f"{name}.k", where, shape, quant, major)
            v = self._buffer(f"{name}.v", where, shape, quant, major)
            self.segments.append(KVSegment(where, h0, h1, k, v, parked=f"{key}.s{n}" if parked else None,
                                           positions_major=major))

    def _buffer(self, name: str, tier: Tier, shape: tuple[int, int, int, int], quant: QuantConfig | None,
                positions_major: bool) -> Stored:
        """The arena's buffer `name` of logical shape [b, h, S, hd], held positions-major when asked."""
        if not positions_major:
            return self.arena.get(name, tier, shape, self.dtype, quant)
        b, h, length, hd = shape
        return self.arena.get(name, tier, (b, length, h, hd), self.dtype, quant).transpose(1, 2)

    def _prefix_of(self, n: int, rotation: QuantConfig | None = None,
                   host: bool = False) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """Segment n's heads of the shared prefix [1, h1-h0, L, hd]: on the compute device, in `rotation`'s
        stored basis when given (made once per segment), or (`host`) a copy in host memory for host
        attention (its own arena buffers, made once; rotated by `cpu_decode_attention` itself)."""
        if self.prefix is None:
            return None, None
        key = (n, rotation is not None, host)
        if key not in self._prefix_parts:
            seg = self.segments[n]
            pk, pv = (x[:, seg.h0:seg.h1] for x in self.prefix)
            if host:
                shape = tuple(pk.shape)
                hk = self.arena.get(f"{self.key}.prefix_host.s{n}.k", Tier.CPU, shape, self.dtype)
                hv = self.arena.get(f"{self.key}.prefix_host.s{n}.v", Tier.CPU, shape, self.dtype)
                hk.copy_(pk)
                hv.copy_(pv)
                pk, pv = hk, hv
            elif rotation is not None:
                pk, pv = rotate_last(pk, rotation), rotate_last(pv, rotation)     # [1, h, L, G]
            self._prefix_parts[key] = (pk, pv)
        return self._prefix_parts[key]

    def _aliased(self, seg: KVSegment) -> bool:
        """True when the segment's home is directly usable by compute (same memory, dense)."""
        same = seg.tier is Tier.GPU or (seg.tier is Tier.CPU and self.device.type == "cpu")
        return same and not isinstance(seg.k, QTensor)

    def _host_side(self, seg: KVSegment, decode: bool) -> bool:
        return decode and self.cpu_attention and seg.tier is not Tier.GPU

    # ---- transfers ------------------------------------------------------------------------------------
    def settle(self) -> None:
        """Wait until every store of this home is in the home (before reading or compacting it)."""
        for pending in self.pending:
            pending.wait()
        self.pending = []

    def unpark(self) -> None:
        """Move the parked gpu segments (their prefill stored on the host) into their device homes, on the
        compute stream (so every later compute and store is ordered after the copy), and a parked shared prefix
        into `{key}.prefix`."""
        self.settle()
        if self._parked_prefix:
            shape = tuple(self.prefix[0].shape)
            held = (self.arena.get(f"{self.key}.prefix.k", Tier.GPU, shape, self.dtype),
                    self.arena.get(f"{self.key}.prefix.v", Tier.GPU, shape, self.dtype))
            for dst, src in zip(held, self.prefix):
                dst.copy_(src)
            self.prefix, self._parked_prefix = held, False
            self._prefix_parts.clear()
        for seg in self.segments:
            if seg.parked is None:
                continue
            quant = self.quant if isinstance(seg.k, QTensor) else None
            shape = tuple(seg.k.shape)
            k = self.arena.get(f"{seg.parked}.k", Tier.GPU, shape, self.dtype, quant)
            v = self.arena.get(f"{seg.parked}.v", Tier.GPU, shape, self.dtype, quant)
            copy(k, seg.k)
            copy(v, seg.v)
            seg.k, seg.v, seg.tier, seg.parked = k, v, Tier.GPU, None

    def load(self, transfers: Transfers, slot: int) -> list[Pending]:
        """Copy each cpu/disk home (not handled on the host) into a device buffer for a decode compute: its
        written positions [0, `written`) only (the buffer's later positions are stale; the decode writes the
        new one and reads no further)."""
        self.settle()
        pendings = []
        for n, seg in enumerate(self.segments):
            if self._host_side(seg, True) or seg.tier is Tier.GPU:
                seg.buf = None
                continue
            if self._aliased(seg):
                seg.buf = (seg.k, seg.v)
                continue
            quant = self.quant if isinstance(seg.k, QTensor) else None
            shape, major = tuple(seg.k.shape), seg.positions_major
            bk = self._buffer(f"kvbuf{slot}.s{n}.k", Tier.GPU, shape, quant, major)
            bv = self._buffer(f"kvbuf{slot}.s{n}.v", Tier.GPU, shape, quant, major)
            seg.buf, seg.buf_slot = (bk, bv), slot
            relay = None
            if seg.tier is Tier.DISK and self.device.type == "cuda":
                relay = (self._buffer(f"kvrelay{slot}.s{n}.k", Tier.CPU, shape, quant, major),
                         self._buffer(f"kvrelay{slot}.s{n}.v", Tier.CPU, shape, quant, major))

            after = None if self.releases is None else self.releases.after(f"kvbuf{slot}.s{n}", address(bk))

            def fn(stream, seg=seg, bk=bk, bv=bv, relay=relay, after=after, first=(2, self.written)):
                e1 = copy(bk, seg.k, stream=stream, relay=relay[0] if relay else None, after=after, first=first)
                e2 = copy(bv, seg.v, stream=stream, relay=relay[1] if relay else None, after=after, first=first)
                return e2 or e1
            pendings.append(transfers.submit("load", fn, threaded=seg.tier is Tier.DISK))
        return pendings

    def store(self, transfers: Transfers, slot: int | str, claims: StagingClaims) -> None:
        """Start writing the positions staged by the last compute into the cpu/disk homes; they are in the
        homes after `settle`. `slot` names the staging buffers (`kvstage{slot}...`)."""
        for n, seg in enumerate(self.segments):
            for c, (kn, vn, t0, r0) in enumerate(seg.staged):
                quant = self.quant if isinstance(seg.k, QTensor) else None
                if self.device.type != "cuda":
                    _write(seg.k, kn, t0, quant, r0)
                    _write(seg.v, vn, t0, quant, r0)
                    continue
                src_k = quantize(kn, quant) if quant and not isinstance(kn, QTensor) else kn
                src_v = quantize(vn, quant) if quant and not isinstance(vn, QTensor) else vn
                if seg.positions_major:         # on the device, so the staging copy is one run per part
                    src_k, src_v = _positions_major(src_k), _positions_major(src_v)
                shape, key = tuple(kn.shape), f"kvstage{slot}.s{n}.r{c}"
                claims.claim(key)
                sk = self._buffer(f"{key}.k", Tier.CPU, shape, quant, seg.positions_major)
                sv = self._buffer(f"{key}.v", Tier.CPU, shape, quant, seg.positions_major)

                def fn(stream, sk=sk, sv=sv, src_k=src_k, src_v=src_v):
                    copy(sk, src_k, stream=stream)
                    return copy(sv, src_v, stream=stream)

                def then(seg=seg, sk=sk, sv=sv, t0=t0, r0=r0):
                    index = (slice(r0, r0 + sk.shape[0]), _ALL, slice(t0, t0 + sk.shape[2]))
                    seg.k[index].copy_(sk)
                    seg.v[index].copy_(sv)
                pending = transfers.submit_host("store", fn, then)
                claims.record(key, pending)
                self.pending.append(pending)
            seg.staged = []

    # ---- compute --------------------------------------------------------------------------------------
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                scale: float, softcap: float | None = None, row0: int = 0,
                skip: tuple[int, int] = (0, 0)) -> torch.Tensor:
        """Attention of the prompt's s new queries (q [b, nh, s, hd]) over its t keys (k/v [b, nkv, t, hd], the
        home's shared prefix of `prefix_len` positions first when it has one), mask [b, 1, s, t]; the cache
        homes' rows [row0, row0 + b) get their own positions [L, t) (gpu homes now, the others on `store`),
        and the prefix's keys/values are kept once (from the chunk of row 0). `skip` (at, n): the keys from
        index `at` of k/v on sit n cache positions further on (a chunk that skipped n pad positions every one of
        its rows has, `GpuBatch.common_pad`); those n positions are written as zeros (masked for every row, but
        never garbage a masked product could turn into NaN). `softcap`: attention-logit soft-capping (Gemma2).
        Returns [b, nh, s, hd]."""
        out = prefill_attention(q, k, v, mask, scale, softcap)
        L = self.prefix_len
        at, n = skip
        self.written = max(self.written, k.shape[2] - L + n)
        if L:
            if row0 == 0:
                self.prefix[0].copy_(k[:1, :, :L])
                self.prefix[1].copy_(v[:1, :, :L])
            k, v, at = k[:, :, L:], v[:, :, L:], at - L                          # [b, nkv, t - L, hd]
        for seg in self.segments:
            ks, vs = k[:, seg.h0:seg.h1], v[:, seg.h0:seg.h1]
            parts = [(ks, vs, 0)]
            if n:
                gap = ks.new_zeros((ks.shape[0], ks.shape[1], n, ks.shape[3]))  # [b, hs, n, hd]
                parts = [(ks[:, :, :at], vs[:, :, :at], 0), (gap, gap, at), (ks[:, :, at:], vs[:, :, at:], at + n)]
            for pk, pv, t0 in parts:
                if not pk.shape[2]:
                    continue
                if seg.tier is Tier.GPU or self._aliased(seg):
                    _write(seg.k, pk, t0, self.quant, row0)
                    _write(seg.v, pv, t0, self.quant, row0)
                else:
                    seg.staged.append((pk, pv, t0, row0))
        return out

    def row_view(self, row0: int, skip: tuple[int, int] = (0, 0)) -> "KVRows":
        """This home as the `CacheAttention` of a prefill chunk whose first row is `row0` (`skip`: `prefill`'s)."""
        return KVRows(self, row0, skip)

    def _chunked_decode(self, q: torch.Tensor, dense_kv, key_valid: torch.Tensor, scale: float,
                        softcap: float | None, rotation: QuantConfig | None = None) -> torch.Tensor:
        """decode_attention over `dense_kv(r0, r1)` -> (k, v) [r1-r0, hs, t+1, hd], a chunk of rows at a time;
        with `rotation`, k/v are [r1-r0, hs, t+1, G] in its stored basis (`chunked_decode_attention`)."""
        rows = decode_chunk_rows(q.shape[0], self.num_kv_heads, self.length, self.head_dim, self.dtype,
                                 self.decode_chunk_bytes)
        return chunked_decode_attention(q, dense_kv, key_valid, scale, rows, softcap, rotation)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: int, key_valid: torch.Tensor,
               key_valid_host: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
        """One new token per row at cache position t: q [b, nh, 1, hd], k/v [b, nkv, 1, hd],
        key_valid [b, t+1] bool on the device (key_valid_host: the same on the host; both already exclude
        keys outside a sliding window; positions [0, L) are the shared prefix's). Returns [b, nh, 1, hd]."""
        g = q.shape[1] // k.shape[1]
        if self.cpu_attention:
            self.settle()                       # the host reads the homes the prefill's stores fill
        self.written = t - self.prefix_len + 1
        outs = []
        for n, seg in enumerate(self.segments):
            qs, ks, vs = q[:, seg.h0 * g:seg.h1 * g], k[:, seg.h0:seg.h1], v[:, seg.h0:seg.h1]
            if self._host_side(seg, True):
                out = self._host_decode(n, qs.to("cpu"), ks.to("cpu"), vs.to("cpu"), t, key_valid_host, scale,
                                        softcap)
                outs.append(out.to(q.device, non_blocking=True))
            else:
                outs.append(self._device_decode(n, qs, ks, vs, t, key_valid, scale, softcap))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)            # [b, nh, 1, hd]

    def decode_start(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: int, key_valid: torch.Tensor,
                     key_valid_host: torch.Tensor, scale: float, softcap: float | None, host: HostAttention,
                     stage_key: str) -> "DecodeJoin":
        """`decode`, with the host segments' attention queued on `host` (CGOPipe): device segments are
        computed (launched) now, host ones run on the host thread; `DecodeJoin.join()` gives [b, nh, 1, hd].
        `stage_key` names the staging buffers (one key per GPU batch: at most one job of it in flight)."""
        g = q.shape[1] // k.shape[1]
        self.settle()
        self.written = t - self.prefix_len + 1
        parts: list[torch.Tensor | HostJob] = []
        for n, seg in enumerate(self.segments):
            qs, ks, vs = q[:, seg.h0 * g:seg.h1 * g], k[:, seg.h0:seg.h1], v[:, seg.h0:seg.h1]
            if self._host_side(seg, True):
                self._prefix_of(n, host=True)           # the host copy made here, before the thread reads it

                def work(qh, kh, vh, n=n):
                    return self._host_decode(n, qh, kh, vh, t, key_valid_host, scale, softcap)
                parts.append(host.start(f"{stage_key}.s{n}", qs, ks, vs, work))
            else:
                parts.append(self._device_decode(n, qs, ks, vs, t, key_valid, scale, softcap))
        return DecodeJoin(parts)

    def _host_decode(self, n: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: int,
                     key_valid_host: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
        """Host segment n's decode on host tensors: the new k/v into the home at t, attention over the
        shared prefix (if any) and [0, t]."""
        seg, tp = self.segments[n], t - self.prefix_len                         # tp: the home position of t
        _write(seg.k, k, tp, self.quant)
        _write(seg.v, v, tp, self.quant)
        index = (_ALL, _ALL, slice(0, tp + 1))
        pk, pv = self._prefix_of(n, host=True)
        return cpu_decode_attention(q, seg.k[index], seg.v[index], key_valid_host, scale, softcap,
                                    prefix=None if pk is None else (pk, pv))

    def _device_decode(self, n: int, qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, t: int,
                       key_valid: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
        """Segment n's decode on the compute device: a gpu home in place, or the buffer `load` filled; the
        keys attended are the shared prefix's (if any) then the home's [0, t - L] (`dense_keys`)."""
        seg, tp = self.segments[n], t - self.prefix_len                         # tp: the home position of t
        if seg.tier is Tier.GPU:
            _write(seg.k, ks, tp, self.quant)
            _write(seg.v, vs, tp, self.quant)
            if isinstance(seg.k, QTensor):
                rot = stored_rotation(seg.k, seg.v)
                pk, pv = self._prefix_of(n, rot)
                fused = quantized_decode_attention(qs, seg.k, seg.v, tp + 1, key_valid, scale, softcap, rot,
                                                   None if pk is None else (pk, pv))
                if fused is not None:
                    return fused
                return self._chunked_decode(                                     # [c, hs, t+1, hd|G] chunks
                    qs, lambda r0, r1: (dense_keys(seg.k[r0:r1], tp + 1, rot, pk),
                                        dense_keys(seg.v[r0:r1], tp + 1, rot, pv)),
                    key_valid, scale, softcap, rot)
            return self._dense_decode(n, qs, seg.k, seg.v, tp, key_valid, scale, softcap)
        bk, bv = seg.buf
        if isinstance(bk, QTensor):
            rot = stored_rotation(bk, bv)
            pk, pv = self._prefix_of(n, rot)
            # the new position quantized once, as the home will hold it: attended so (as a gpu home's own
            # decode does, so every placement gives the same tokens) and staged for `store` as it is
            ks, vs = quantize(ks, bk.config), quantize(vs, bv.config)
            _write(bk, ks, tp, None)                   # the loaded copy only: the home gets it on `store`
            _write(bv, vs, tp, None)
            out = quantized_decode_attention(qs, bk, bv, tp + 1, key_valid, scale, softcap, rot,
                                             None if pk is None else (pk, pv))
            if out is None:
                out = self._chunked_decode(                                          # [c, hs, t+1, hd|G] chunks
                    qs, lambda r0, r1: (dense_keys(bk[r0:r1], tp + 1, rot, pk),
                                        dense_keys(bv[r0:r1], tp + 1, rot, pv)),
                    key_valid, scale, softcap, rot)
        else:
            _write(bk, ks, tp, None)
            _write(bv, vs, tp, None)
            out = self._dense_decode(n, qs, bk, bv, tp, key_valid, scale, softcap)
        if not self._aliased(seg):
            seg.staged.append((ks, vs, tp, 0))
        if self.releases is not None:
            self.releases.record(f"kvbuf{seg.buf_slot}.s{n}", address(bk))
        seg.buf = None
        return out

    def _dense_decode(self, n: int, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tp: int,
                      key_valid: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
        """Decode attention of segment n over dense device keys/values k, v (home positions [0, tp], the new
        one written), after the shared prefix if any -> [b, hs*g, 1, hd]."""
        pk, pv = self._prefix_of(n)
        return decode_attention(qs, dense_keys(k, tp + 1, None, pk), dense_keys(v, tp + 1, None, pv),
                                key_valid, scale, softcap)

    def compact(self, keep: torch.Tensor) -> None:
        """Keep only rows `keep` (ascending indices into the current rows), in place in every home."""
        self.settle()
        n = keep.numel()
        for seg in self.segments:
            for name in ("k", "v"):
                home = getattr(seg, name)
                idx = keep.to(home.device)
                kept = home.index_select(0, idx)
                home[:n].copy_(kept)
                setattr(seg, name, home[:n])
        self.rows = n


class DecodeJoin:
    """A decode started by `KVHome.decode_start`: per segment, its device output or its host job."""

    def __init__(self, parts: list[torch.Tensor | HostJob]) -> None:
        self.parts = parts

    def join(self) -> torch.Tensor:
        """The attention output [b, nh, 1, hd] on the compute device (waits for the host jobs)."""
        outs = [p.join() if isinstance(p, HostJob) else p for p in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


class KVRows:
    """A `KVHome` seen by one prefill row chunk: `prefill` writes the home's rows [row0, row0 + b)."""

    def __init__(self, home: KVHome, row0: int, skip: tuple[int, int] = (0, 0)) -> None:
        self.home, self.row0, self.skip = home, row0, skip

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                scale: float, softcap: float | None = None) -> torch.Tensor:
        return self.home.prefill(q, k, v, mask, scale, softcap, self.row0, self.skip)

    def decode(self, *args, **kwargs) -> torch.Tensor:
        raise RuntimeError("KVRows: decode runs over the whole home, never a prefill chunk")
