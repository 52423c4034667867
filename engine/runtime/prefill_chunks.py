"""Chunked prefill: one layer's prefill of a GPU batch computed over chunks of rows, in place in its hidden.

The chunks come from `engine.policy.working.row_chunks` (the memory model's own rule), so a layer's
intermediates span one chunk, never the whole batch x prompt. Rows are independent in every layer: a
chunk sees its own positions, key validity and cache rows (`RowView`, `KVHome.row_view`), and its output is
written over its rows of the batch's hidden [b, s, h] (the input rows are dead once the chunk's layer has
read them). With one chunk the layer runs on the whole batch exactly as without chunking.
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
    """The `AttentionBatch` of rows [r0, r1) of a GPU batch at its prefill."""

    def __init__(self, batch: GpuBatch, r0: int, r1: int) -> None:
        self.positions = batch.positions[r0:r1]                     # [c, s]
        self.prefix_positions = batch.prefix_positions              # [1, L]
        self.key_valid = batch.key_valid[r0:r1]                     # [c, S]
        self.key_valid_host = batch.key_valid_host[r0:r1]           # [c, S]
        self.t = batch.t

    @property
    def prefill(self) -> bool:
        return True


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
        rows, view = kv.row_view(r0), RowView(batch, r0, r1)
        out = (suffix_attention(c, f, w, rows, view, layer, pk, pv, xs[r0:r1]) if prefix
               else attention_layer(c, f, w, rows, view, layer, xs[r0:r1]))       # [c, s, h]
        xs[r0:r1].copy_(out)
    return (px, xs) if prefix else xs


def mlp_prefill(f: ModelFamily, w: Weights, x: Hidden, chunks: list[tuple[int, int]],
                upto: Upto = arrived) -> Hidden:
    """The MLP (or MoE block) at a prefill over row `chunks`; returns the new hidden."""
    if isinstance(x, tuple):
        upto(None)
        return f.mlp(w, x[0]), mlp_prefill(f, w, x[1], chunks)                     # ([1, L, h], [b, s, h])
    if len(chunks) == 1:
        upto(None)
        return f.mlp(w, x)                                                         # [b, s, h]
    for r0, r1 in chunks:
        upto(r1)
        x[r0:r1].copy_(f.mlp(w, x[r0:r1]))                                         # [c, s, h]
    return x
