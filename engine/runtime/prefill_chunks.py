"""Chunked prefill: one layer's prefill of a GPU batch computed over chunks of rows, in place in its hidden.

The chunks come from `engine.policy.working.row_chunks` (the memory model's own rule), so a layer's
intermediates span one chunk, never the whole batch x prompt. Rows are independent in every layer: a
chunk sees its own positions, key validity and cache rows (`RowView`, `KVHome.row_view`), and its output is
written over its rows of the batch's hidden [b, s, h] (the input rows are dead once the chunk's layer has
read them). With one chunk the layer runs on the whole batch exactly as without chunking.
Rows come sorted by length, so the rows of a chunk share leading pad positions (`GpuBatch.common_pad`): a
chunk computes its columns from the first one any of its rows has a token in, in every layer, and the cache
positions it skips are written as zeros (`KVHome.prefill`'s `skip`). Those columns of the hidden hold no
row's token and nothing reads them (the head reads the last column).
A shared prefix [1, L] is computed once per layer, before the suffix chunks, which reuse its keys/values.
A hidden still arriving from the host by rows (`engine.runtime.act_homes`) is read chunk by chunk: `upto(r1)`
before a chunk makes the compute stream wait for its rows only.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.models.attention import attention_layer, prefix_attention, suffix_attention
from engine.models.base import ModelFamily, Weights
from engine.models.config import ModelConfig
from engine.runtime.act_homes import arrived
from engine.runtime.batch import GpuBatch
from engine.runtime.kv_cache import KVHome

Hidden = torch.Tensor | tuple[torch.Tensor, torch.Tensor]   # [b, s, h], or (prefix [1, L, h], [b, s, h])
Upto = Callable[[int | None], None]                          # wait for the hidden's rows [0, r) (None: all)


class RowView:
    """The `AttentionBatch` of rows [r0, r1) of a GPU batch at its prefill, from suffix column `col0` on (the
    columns before it are padding in every row of the chunk; key validity drops them after the prefix's L)."""

    def __init__(self, batch: GpuBatch, r0: int, r1: int, col0: int = 0) -> None:
        L = batch.prefix_len
        self.positions = batch.positions[r0:r1, col0:]              # [c, s - col0]
        self.prefix_positions = batch.prefix_positions              # [1, L]
        self.key_valid = _drop(batch.key_valid[r0:r1], L, col0)     # [c, S - col0]
        self.key_valid_host = _drop(batch.key_valid_host[r0:r1], L, col0)
        self.t = batch.t

    @property
    def prefill(self) -> bool:
        return True


def _drop(valid: torch.Tensor, at: int, n: int) -> torch.Tensor:
    """valid [c, S] without its columns [at, at + n) -> [c, S - n] (a view when nothing or the front goes)."""
    if not n:
        return valid
    return valid[:, n:] if not at else torch.cat((valid[:, :at], valid[:, at + n:]), dim=1)


def attention_prefill(c: ModelConfig, f: ModelFamily, w: Weights, kv: KVHome, batch: GpuBatch, layer: int,
                      x: Hidden, chunks: list[tuple[int, int]], upto: Upto = arrived) -> Hidden:
    """Attention layer `layer` at the prefill of `batch` over row `chunks`; returns the new hidden."""
    prefix = isinstance(x, tuple)
    if prefix:
        px, xs = x
        px, pk, pv = prefix_attention(c, f, w, batch, layer, px)                   # [1, L, h], [1, nkv, L, hd]
    else:
        xs = x
    if len(chunks) == 1:
        upto(None)
        out = (suffix_attention(c, f, w, kv, batch, layer, pk, pv, xs) if prefix
               else attention_layer(c, f, w, kv, batch, layer, xs))                # [b, s, h]
        return (px, out) if prefix else out
    for r0, r1 in chunks:
        upto(r1)
        col0 = batch.common_pad(r0, r1)
        rows, view = kv.row_view(r0, (batch.prefix_len, col0)), RowView(batch, r0, r1, col0)
        out = (suffix_attention(c, f, w, rows, view, layer, pk, pv, xs[r0:r1, col0:]) if prefix
               else attention_layer(c, f, w, rows, view, layer, xs[r0:r1, col0:]))  # [c, s - col0, h]
        xs[r0:r1, col0:].copy_(out)
    return (px, xs) if prefix else xs


def mlp_prefill(f: ModelFamily, w: Weights, x: Hidden, chunks: list[tuple[int, int]], batch: GpuBatch,
                upto: Upto = arrived) -> Hidden:
    """The MLP (or MoE block) at `batch`'s prefill over row `chunks` (each from its common pad on, as
    `attention_prefill` computes it); returns the new hidden."""
    if isinstance(x, tuple):
        upto(None)
        return f.mlp(w, x[0]), mlp_prefill(f, w, x[1], chunks, batch)              # ([1, L, h], [b, s, h])
    if len(chunks) == 1:
        upto(None)
        return f.mlp(w, x)                                                         # [b, s, h]
    for r0, r1 in chunks:
        upto(r1)
        col0 = batch.common_pad(r0, r1)
        x[r0:r1, col0:].copy_(f.mlp(w, x[r0:r1, col0:]))                           # [c, s - col0, h]
    return x
