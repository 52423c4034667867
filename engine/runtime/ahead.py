"""The next block's prefill, run ahead in row chunks on the running block's decode weight passes.

In the weight-bound regime a decode step streams every offloaded weight once and leaves the GPU's compute
mostly idle, while a prefill is compute-bound; run one after the other, the prefill is a quarter of the
flexgen shape's wall. With `Policy.prefill_ahead`, while block b decodes, each decode
step also carries a pass of block b + 1's rows (`engine.policy.working.rows_per_pass` of them, cut into
chunks of at most `chunk_tokens` tokens as a prefill's row chunks are) through every layer, on the weights
that step has loaded anyway: the executor calls `AheadPrefill` after the last GPU batch's compute of each layer. The chunk's
keys and values go to block b + 1's cache homes, whose gpu segments are parked on the host
(`KVHome(park_key=...)`; device-to-host is the idle direction of the link) and moved to the device once at
the switch (`finish`). The chunk's first tokens are chosen at the head, in the step its pass reaches it.

The passes are planned so the whole prefill fits block b's decode steps (`rows_per_pass`); if block b ends
early, the executor keeps streaming weights for the passes left. Every row's prefill is the same
computation as the block-by-block prefill's row chunks, so the tokens are those of the block-by-block run.

A GPU batch with a shared prefix (`GpuBatch.prefix_len`: a system prompt, few-shot turns) computes it once,
as its own prefill does: the pass holding the batch's first rows carries the prefix [1, L] through every layer
before their chunks (`Chunk.prefix`) and keeps each layer's prefix keys/values in `prefixes[(j, k)]` (the
device buffers `kvpark.{j}.{k}.prefix`, which are the parked home's own prefix where it holds the prefix once);
every chunk of the batch, in that pass and later ones, attends to them (`suffix_attention`) as the plain
prefill's row chunks do.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from engine.models.attention import attention_layer, prefix_attention, suffix_attention
from engine.models.base import LayerSpec, ModelFamily, Weights
from engine.models.config import ModelConfig
from engine.policy.buffers import ahead_passes, ahead_stage_slots
from engine.policy.working import row_chunks
from engine.runtime.block_state import BlockState
from engine.runtime.prefill_chunks import RowView
from engine.runtime.selector import end_step
from engine.runtime.transfers import Transfers


@dataclass
class Chunk:
    """Rows [r0, r1) of the next block's GPU batch k, and their hidden states [r1 - r0, s, h] between layers
    (s: the prompt, or its own tokens past a shared prefix); `prefix`: the batch's shared prefix instead, its
    hidden states [1, L, h]."""

    k: int
    r0: int
    r1: int
    x: torch.Tensor | None = None
    prefix: bool = False

PrefixKV = dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]    # (layer j, batch k) -> [1, nkv, L, hd] x2


class AheadPrefill:
    """Block b + 1's prefill (`state`: its batches, selector and parked cache homes), pass by pass; `prefixes`
    the buffers of the shared prefixes' keys/values, for every (attention layer j, batch k with a prefix)."""

    def __init__(self, state: BlockState, per_pass: int, chunk_tokens: int, prefixes: PrefixKV | None = None) -> None:
        self.state = state
        self.stage_slots = ahead_stage_slots(len({j for j, _ in state.kv}))    # staging sets its stores take in turn
        self.prefixes = prefixes or {}
        self.passes: deque[list[Chunk]] = deque()
        self.current: list[Chunk] | None = None
        self.picked: list[dict[int, int]] = [{} for _ in state.batches]
        for part in ahead_passes([b.size for b in state.batches], per_pass):
            chunks = []
            for k, lo, n in part:
                batch = state.batches[k]
                if batch.prefix_len and lo == 0:
                    chunks.append(Chunk(k, 0, 0, prefix=True))
                chunks += [Chunk(k, lo + a, lo + b) for a, b in
                           row_chunks(n, batch.prompt_len - batch.prefix_len, chunk_tokens)]
            self.passes.append(chunks)

    @property
    def idle(self) -> bool:
        """True when no pass is in flight and none is left."""
        return self.current is None and not self.passes

    def layer(self, j: int, spec: LayerSpec, w: Weights, c: ModelConfig, f: ModelFamily, transfers: Transfers,
              last: bool) -> None:
        """Layer j (`spec`, weights `w`) for the pass in flight; layer 0 starts the next pass, `last` (the head)
        ends it."""
        if j == 0 and self.current is None and self.passes:
            self.current = self.passes.popleft()
        if self.current is None:
            return
        st = self.state
        for ch in self.current:
            batch = st.batches[ch.k]
            if ch.prefix:
                self._prefix_layer(j, spec, w, c, f, ch)
            elif spec.kind == "embed":
                ch.x = f.embed(w, batch.input_ids[ch.r0:ch.r1], batch.positions[ch.r0:ch.r1])   # [c, s, h]
            elif spec.kind == "attention":
                kv, view = st.kv[(j, ch.k)], RowView(batch, ch.r0, ch.r1)
                if batch.prefix_len:
                    pk, pv = self.prefixes[(j, ch.k)]                                             # [1, nkv, L, hd]
                    ch.x = suffix_attention(c, f, w, kv.row_view(ch.r0), view, spec.index, pk, pv, ch.x)
                else:
                    ch.x = attention_layer(c, f, w, kv.row_view(ch.r0), view, spec.index, ch.x)  # [c, s, h]
                kv.store(transfers, f"ahead{st.stores % self.stage_slots}", st.claims)
                st.stores += 1
            elif spec.kind == "mlp":
                ch.x = f.mlp(w, ch.x)                                                              # [c, s, h]
            else:
                self._head(ch, f.head(w, ch.x[:, -1]))                                             # [c, v]
                ch.x = None
        if last:
            self.current = None

    def _prefix_layer(self, j: int, spec: LayerSpec, w: Weights, c: ModelConfig, f: ModelFamily, ch: Chunk) -> None:
        """Layer j of GPU batch `ch.k`'s shared prefix, as its own prefill computes it; an attention layer keeps
        the prefix's keys/values for the batch's chunks. The head has nothing to pick for it."""
        batch = self.state.batches[ch.k]
        if spec.kind == "embed":
            ch.x = f.embed(w, batch.prefix_ids, batch.prefix_positions)                            # [1, L, h]
        elif spec.kind == "attention":
            ch.x, pk, pv = prefix_attention(c, f, w, batch, spec.index, ch.x)                # [1, L, h], [1, nkv, L, hd]
            bk, bv = self.prefixes[(j, ch.k)]
            bk.copy_(pk)
            bv.copy_(pv)
        elif spec.kind == "mlp":
            ch.x = f.mlp(w, ch.x)                                                                  # [1, L, h]
        else:
            ch.x = None

    def _head(self, ch: Chunk, logits: torch.Tensor) -> None:
        """The chunk's first tokens: recorded as the block-by-block prefill's head would."""
        batch = self.state.batches[ch.k]
        tokens, finished = self.state.select([batch.rows[r] for r in range(ch.r0, ch.r1)], logits)
        end_step(self.state.select)                     # the chunk's next masks start now
        for r, tok, fin in zip(range(ch.r0, ch.r1), tokens, finished):
            batch.generated[r] += 1
            if fin or batch.generated[r] >= batch.max_new[r]:
                batch.finish(r)
            else:
                self.picked[ch.k][r] = int(tok)

    def finish(self) -> BlockState:
        """The switch, after the running block has ended: the cache's gpu share to the device, each batch
        past its prompt with its first tokens to feed (compacted when enough rows ended); the block's state."""
        st = self.state
        for kv in st.kv.values():
            kv.unpark()
        for k, batch in enumerate(st.batches):
            batch.advance(batch.prompt_len)
            batch.set_next(self.picked[k])
            st.compact(k)
        return st
