"""`BlockState`: everything the executor holds for one block, made at block start and dropped at its end.

Indices as in the executor: i step (0 = prefill), j layer (embed, attention/mlp per decoder layer, head),
k GPU batch. The executor keeps only run-long state (weight homes, arena, transfers, budget) on itself;
a block's rows, cache homes, hidden states and pending transfers live here, so dropping the one object
drops every reference into the block's buffers (pending transfers' closures hold cache views).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.runtime.act_homes import ActHomes
from engine.runtime.batch import GpuBatch
from engine.runtime.kv_buffers import StagingClaims
from engine.runtime.kv_cache import DecodeJoin, KVHome
from engine.runtime.selector import TokenSelector
from engine.runtime.transfers import Pending

Block = tuple[list[list[int]], list[int], TokenSelector]     # (prompts, max_new_tokens, select) of one block


class AttentionInFlight(NamedTuple):
    """A decode attention layer started but not joined (MoE pipeline): its host join, the layer's weights
    and its input x [b, 1, h] (the residual), for `attention_output` at `join_attention`."""

    join: DecodeJoin
    weights: dict[str, torch.Tensor]
    x: torch.Tensor


# [b, s, h], or (prefix [1, L, h], [b, s, h]), or an attention layer in flight
Hidden = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | AttentionInFlight | None


class StepResult(NamedTuple):
    """What one step's head decided for one GPU batch: `advanced` cache positions written, and for each
    batch index in `live` (the rows the selector saw) its token and whether it finished."""

    advanced: int
    live: list[int]
    tokens: list[int]
    finished: list[bool]


@dataclass
class BlockState:
    """One block's state. `kv` maps (j, k) of attention layers to their cache homes; `hidden[k]` is GPU
    batch k's hidden states between layers; `inflight` the transfers to wait for at the next `sync`;
    `wpend[(i, j)]` / `cpend[(i, j, k)]` the weight / cache loads a compute waits for; `weights` the
    (i, j, tensors) of the layer last fetched; `results[k]` GPU batch k's latest `StepResult` from the
    head (a pipeline's last stage sends them back to the first); `stores` counts cache stores (their staging
    buffers take turns: two for the prefill, `buffers.decode_stage_slots` for decode); `t0` is when the current
    step began (perf_counter seconds)."""

    select: TokenSelector
    batches: list[GpuBatch]
    kv: dict[tuple[int, int], KVHome]
    acts: ActHomes
    hidden: list[Hidden]
    inflight: list[Pending] = field(default_factory=list)
    claims: StagingClaims = field(default_factory=StagingClaims)
    stores: int = 0
    wpend: dict[tuple[int, int], list[Pending]] = field(default_factory=dict)
    cpend: dict[tuple[int, int, int], list[Pending]] = field(default_factory=dict)
    weights: tuple[int, int, dict[str, torch.Tensor]] | None = None
    results: dict[int, StepResult] = field(default_factory=dict)
    t0: float = field(default_factory=time.perf_counter)

    @property
    def all_done(self) -> bool:
        """Whether every row of every GPU batch has ended."""
        return all(b.done for b in self.batches)

    def compact(self, k: int) -> list[tuple[int, int, int]]:
        """Drop GPU batch k's ended rows from its bookkeeping and cache homes when enough have ended. Returns
        the (i, j, k) of the batch's cache loads already issued (`cpend`, a prefetch at the head): they read
        the homes before the compaction, so the caller loads them again; the host waits for them first, as
        the compaction rewrites the homes they read."""
        batch = self.batches[k]
        keep = batch.compact_index()
        if keep is None or keep.numel() == 0:
            return []
        stale = [key for key in self.cpend if key[2] == k]
        for key in stale:
            for pending in self.cpend.pop(key):
                pending.complete()
        for (_, kk), kv in self.kv.items():
            if kk == k:
                kv.compact(keep)
        batch.compact(keep)
        return stale

    def track(self, pendings: list[Pending]) -> list[Pending]:
        """Remember `pendings` for the next sync; returns them."""
        self.inflight.extend(pendings)
        return pendings

    def wait_inflight(self) -> None:
        """Wait for every transfer issued since the last sync."""
        for pending in self.inflight:
            pending.wait()
        self.inflight = []
