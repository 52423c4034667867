"""The fused Triton kernel behind `engine.models.attention.quantized_decode_attention` on CUDA (imports Triton:
load lazily).

Decode attention of one new query per row over a 4-bit cache, read packed: one program per (row, kv head)
walks the row's 4-bit positions in blocks of BLOCK_T, with an online softmax in float32, started from a shared
prefix's softmax state when there is one (`quant_decode.prefix_state`: the prefix is every row's, so its scores
are two batched GEMMs for all rows, not a loop in every program). Each packed byte is unpacked and dequantized
in registers exactly as `engine.quant.kernels.affine_dequant` writes it (`round_as_addcmul`), so the keys and
values attended are the dense ones of the chunked path, bit for bit. No dense copy of the cache exists, and
one launch covers every row: the chunked path launched several kernels per chunk of ~20 rows, which on
OPT-30B at 192 rows made the compute thread, not the link, bound the decode step (`engine.runtime.step_clock`).

Query heads: with one a kv head (MHA, GB = 1) the program keeps that head's softmax in vectors over the
head's width. Under grouped-query attention it keeps one per query head of the kv head's group (GB, the group
size rounded up to a power of two, the extra heads masked), so each key and value is loaded and dequantized
once for the group instead of once per query head: eight times fewer for Llama-3-70B (its 4,608-row
wrangling job's decode steps: `python benchmarks/throughput/throughput.py --workload wrangle --model llama-3-70b
--rows 4608 --gpu-memory 16GiB --cpu-memory 100GiB --no-warmup --policy auto --trials 0 --clock`,
benchmarks/records/h100/throughput.jsonl). A group of one gains nothing from [BT, GB, W] tiles, so MHA takes
the vector code (`GB == 1`, resolved when the kernel compiles).

Layouts (checked by the caller): q [b, nh, 1, D] with a contiguous last dim; the cache's data
[b, nkv, S, NG, HALF] uint8 and mn/scale [b, nkv, S, NG, 1] with their two last dims contiguous; key_valid
[b, T] as uint8 (its row stride free); the state m, l [b, nh] and acc [b, nh, D] float32, contiguous. D is the
logical width (head_dim, or the rotated basis' width) and NG * HALF * 2 >= D its stored width. The output
[b, nh, 1, D] is contiguous in q's dtype.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from engine.quant._dequant_triton import TL_DTYPES, round_as_addcmul

_TILE = 2048           # key positions x query heads x packed bytes per loop step (`block_t`)
# The integers that change from one decode step to the next (the positions written, and the key mask's row
# stride). Triton specializes an integer argument on being 1 or a multiple of 16 and compiles the kernel again
# the first time it is: a decode step whose T first reaches a multiple of 16 stalls ~1.1 s in the middle of a
# run (step 3 of prompt 77, T = 80; step 16 of prompt 512, T = 528; in a process's first run on a machine whose
# Triton cache on disk is empty). They only bound loops and offset the one-byte key mask, so nothing is lost by
# not specializing on them.
_PER_STEP = ("T", "valid_b")


def block_t(block_w: int, gb: int) -> int:
    """Key positions per loop step for packed rows of `block_w` bytes and `gb` query heads a program: 32
    positions of a 128-wide head for one query head, fewer as the heads sharing the keys multiply the tile."""
    return max(8, _TILE // (block_w * gb))


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _online(s, m, l, acc_e, acc_o, v_e, v_o, GB: tl.constexpr):
    """One block's scores s ([BT], or [BT, GB] for a group; -inf where masked) and values v_e/v_o [BT, BLOCK_W]
    into each query head's running max m and sum l (a scalar, or [GB]) and accumulators acc_e/acc_o ([BLOCK_W],
    or [GB, BLOCK_W])."""
    m_new = tl.maximum(m, tl.max(s, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    if GB == 1:
        p = tl.exp(s - m_safe)                                                # [BT]
        l = l * alpha + tl.sum(p, axis=0)
        acc_e = acc_e * alpha + tl.sum(p[:, None] * v_e, axis=0)
        acc_o = acc_o * alpha + tl.sum(p[:, None] * v_o, axis=0)
    else:
        p = tl.exp(s - m_safe[None, :])                                       # [BT, GB]
        l = l * alpha + tl.sum(p, axis=0)
        acc_e = acc_e * alpha[:, None] + tl.sum(p[:, :, None] * v_e[:, None, :], axis=0)
        acc_o = acc_o * alpha[:, None] + tl.sum(p[:, :, None] * v_o[:, None, :], axis=0)
    return m_new, l, acc_e, acc_o


@triton.jit
def _scores(k_e, k_o, q_e, q_o, valid, softcap, GB: tl.constexpr, SOFTCAP: tl.constexpr):
    """Keys k_e/k_o [BT, BLOCK_W] against the queries q_e/q_o ([BLOCK_W], or [GB, BLOCK_W] for a group) ->
    scores [BT] or [BT, GB], soft-capped when SOFTCAP, -inf where `valid` [BT] is False."""
    if GB == 1:
        s = tl.sum(k_e * q_e[None, :] + k_o * q_o[None, :], axis=1)                                  # [BT]
        keep = valid
    else:
        s = tl.sum(k_e[:, None, :] * q_e[None, :, :] + k_o[:, None, :] * q_o[None, :, :], axis=2)    # [BT, GB]
        keep = valid[:, None]
    if SOFTCAP:
        s = _tanh(s / softcap) * softcap
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _q4_pair(data_ptr, mn_ptr, scale_ptr, d_off, m_off, c, grp, bmask, MID: tl.constexpr, OUT: tl.constexpr):
    """Packed bytes c of 4-bit rows (offsets d_off / m_off [BT, 1] of data / mn and scale) dequantized as
    `affine_dequant` writes them -> the low and high nibbles' [BT, BLOCK_W] float32 tiles."""
    byte = tl.load(data_ptr + d_off + c[None, :], mask=bmask, other=0)
    mn = tl.load(mn_ptr + m_off + grp[None, :], mask=bmask, other=0.0).to(tl.float32)
    sc = tl.load(scale_ptr + m_off + grp[None, :], mask=bmask, other=0.0).to(tl.float32)
    lo = round_as_addcmul(tl.fma((byte & 15).to(tl.float32), sc, mn), MID, OUT).to(tl.float32)
    hi = round_as_addcmul(tl.fma((byte >> 4).to(tl.float32), sc, mn), MID, OUT).to(tl.float32)
    return lo, hi


@triton.jit(do_not_specialize=_PER_STEP)
def _quant_decode_kernel(q_ptr, kd_ptr, kmn_ptr, ksc_ptr, vd_ptr, vmn_ptr, vsc_ptr, m0_ptr, l0_ptr, a0_ptr,
                         valid_ptr, out_ptr, T, D, nkv, g, scale, softcap,
                         q_b, q_h, kd_b, kd_h, kd_t, km_b, km_h, km_t, vd_b, vd_h, vd_t, vm_b, vm_h, vm_t,
                         valid_b, out_b, out_h,
                         HALF: tl.constexpr, W2: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr,
                         GB: tl.constexpr, MID: tl.constexpr, OUT: tl.constexpr, SOFTCAP: tl.constexpr,
                         STATE: tl.constexpr):
    pid = tl.program_id(0)
    row = (pid // nkv).to(tl.int64)
    kvh = (pid % nkv).to(tl.int64)
    c = tl.arange(0, BLOCK_W)                                                 # byte column: elements 2c, 2c+1
    in_e = (2 * c < D) & (c < W2)
    in_o = (2 * c + 1 < D) & (c < W2)
    if GB == 1:                                                               # one query head: the kv head's
        qrow = q_ptr + row * q_b + kvh * q_h
        q_e = tl.load(qrow + 2 * c, mask=in_e, other=0.0).to(tl.float32) * scale
        q_o = tl.load(qrow + 2 * c + 1, mask=in_o, other=0.0).to(tl.float32) * scale
        if STATE:                                                             # the prefix's softmax state
            at = row * nkv + kvh
            m = tl.load(m0_ptr + at)
            l = tl.load(l0_ptr + at)
            acc_e = tl.load(a0_ptr + at * D + 2 * c, mask=in_e, other=0.0)
            acc_o = tl.load(a0_ptr + at * D + 2 * c + 1, mask=in_o, other=0.0)
        else:
            m = tl.max(tl.full([BLOCK_T], float("-inf"), tl.float32), axis=0)
            l = tl.sum(tl.zeros([BLOCK_T], tl.float32), axis=0)
            acc_e = tl.zeros([BLOCK_W], tl.float32)
            acc_o = tl.zeros([BLOCK_W], tl.float32)
    else:                                                                     # the group's query heads
        gi = tl.arange(0, GB)
        in_g = gi < g
        heads = kvh * g + gi.to(tl.int64)                                     # [GB]
        qrow = q_ptr + row * q_b + heads[:, None] * q_h                       # [GB, 1]
        q_e = tl.load(qrow + 2 * c[None, :], mask=in_g[:, None] & in_e[None, :], other=0.0).to(tl.float32) * scale
        q_o = tl.load(qrow + 2 * c[None, :] + 1, mask=in_g[:, None] & in_o[None, :], other=0.0).to(tl.float32) * scale
        if STATE:
            at = row * nkv * g + heads                                        # [GB]
            m = tl.load(m0_ptr + at, mask=in_g, other=float("-inf"))
            l = tl.load(l0_ptr + at, mask=in_g, other=0.0)
            acc_e = tl.load(a0_ptr + at[:, None] * D + 2 * c[None, :], mask=in_g[:, None] & in_e[None, :], other=0.0)
            acc_o = tl.load(a0_ptr + at[:, None] * D + 2 * c[None, :] + 1, mask=in_g[:, None] & in_o[None, :],
                            other=0.0)
        else:
            m = tl.full([GB], float("-inf"), tl.float32)
            l = tl.zeros([GB], tl.float32)
            acc_e = tl.zeros([GB, BLOCK_W], tl.float32)
            acc_o = tl.zeros([GB, BLOCK_W], tl.float32)
    tt0 = tl.arange(0, BLOCK_T)
    grp = c // HALF
    for t0 in range(0, T, BLOCK_T):                                           # the 4-bit positions
        tt = t0 + tt0
        live = tt < T
        bmask = live[:, None] & (c < W2)[None, :]
        t64 = tt[:, None].to(tl.int64)
        k_e, k_o = _q4_pair(kd_ptr, kmn_ptr, ksc_ptr, row * kd_b + kvh * kd_h + t64 * kd_t,
                            row * km_b + kvh * km_h + t64 * km_t, c, grp, bmask, MID, OUT)
        valid = tl.load(valid_ptr + row * valid_b + tt, mask=live, other=0) != 0
        s = _scores(k_e, k_o, q_e, q_o, valid & live, softcap, GB, SOFTCAP)   # (q is 0 past D)
        v_e, v_o = _q4_pair(vd_ptr, vmn_ptr, vsc_ptr, row * vd_b + kvh * vd_h + t64 * vd_t,
                            row * vm_b + kvh * vm_h + t64 * vm_t, c, grp, bmask, MID, OUT)
        m, l, acc_e, acc_o = _online(s, m, l, acc_e, acc_o, v_e, v_o, GB)
    inv = tl.where(l > 0, 1.0 / l, 0.0)                                       # no valid key: zeros, not NaN
    if GB == 1:
        orow = out_ptr + row * out_b + kvh * out_h
        tl.store(orow + 2 * c, (acc_e * inv).to(OUT), mask=in_e)
        tl.store(orow + 2 * c + 1, (acc_o * inv).to(OUT), mask=in_o)
    else:
        orow = out_ptr + row * out_b + heads[:, None] * out_h                 # [GB, 1]
        tl.store(orow + 2 * c[None, :], (acc_e * inv[:, None]).to(OUT), mask=in_g[:, None] & in_e[None, :])
        tl.store(orow + 2 * c[None, :] + 1, (acc_o * inv[:, None]).to(OUT), mask=in_g[:, None] & in_o[None, :])


def quant_decode_triton(q: torch.Tensor, k_parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                        v_parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], t: int, width: int,
                        key_valid: torch.Tensor, scale: float, softcap: float | None,
                        state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """One launch on the current CUDA stream (asynchronous): q [b, nh, 1, width] over positions [0, t) of k/v
    (data, mn, scale), key_valid [b, t], continuing from `state` (m, l [b, nh], acc [b, nh, width] float32,
    contiguous: a prefix's softmax, `quant_decode.prefix_state`) when given -> [b, nh, 1, width]. Layouts as
    the module doc says."""
    b, nh = q.shape[0], q.shape[1]
    kd, kmn, ksc = k_parts
    vd, vmn, vsc = v_parts
    nkv, half = kd.shape[1], kd.shape[-1]
    w2 = kd.shape[-2] * half
    out = torch.empty((b, nh, 1, width), dtype=q.dtype, device=q.device)     # [b, nh, 1, D]
    m0, l0, a0 = state if state is not None else (q, q, q)                    # never read without a state
    valid = key_valid.view(torch.uint8)
    block_w = triton.next_power_of_2(w2)
    g = nh // nkv
    gb = triton.next_power_of_2(g)
    on_device = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()     # cpu: interpreter
    strides = (q.stride(0), q.stride(1), kd.stride(0), kd.stride(1), kd.stride(2), kmn.stride(0),
               kmn.stride(1), kmn.stride(2), vd.stride(0), vd.stride(1), vd.stride(2), vmn.stride(0),
               vmn.stride(1), vmn.stride(2), valid.stride(0), out.stride(0), out.stride(1))
    with on_device:
        _quant_decode_kernel[(b * nkv,)](
            q, kd, kmn, ksc, vd, vmn, vsc, m0, l0, a0, valid, out, t, width, nkv, g, scale,
            1.0 if softcap is None else float(softcap), *strides,
            HALF=half, W2=w2, BLOCK_W=block_w, BLOCK_T=block_t(block_w, gb), GB=gb,
            MID=TL_DTYPES[kmn.dtype], OUT=TL_DTYPES[q.dtype], SOFTCAP=softcap is not None, STATE=state is not None)
    return out
