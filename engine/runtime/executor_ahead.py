"""`AheadDriver`: the executor's side of the ahead prefill (`engine.runtime.ahead`, `Policy.prefill_ahead`).

It starts the next block's prefill on the running block's decode steps (within the budgets, else the next
block runs its own prefill), runs one of its layers on the weights each step loads anyway, and at the block's
end switches to the state it left (or abandons it on an error, giving its buffers back). A mixin of
`engine.runtime.executor.Executor`: it works on the executor's policy, budget, arena, block states and
transfers; what one ahead pass computes is `AheadPrefill`'s.
"""
from __future__ import annotations

import logging

import torch

from engine.models.layers import reserve_positions
from engine.policy.working import rows_per_pass, staged_kv_heads, working_bytes
from engine.runtime.ahead import AheadPrefill, PrefixKV
from engine.runtime.batch import GpuBatch
from engine.runtime.block_state import Block, BlockState
from engine.runtime.schedule import Action
from engine.storage.tiers import BudgetExceeded, Tier

log = logging.getLogger(__name__)


class AheadDriver:
    """The ahead prefill's methods of `Executor` (see the module doc); state on the executor: `ahead` (the
    running `AheadPrefill` or None), `_ahead_work` (its reserved device bytes), `_host_tag`/`_next_tag`
    (the host cache homes alternate "kv" / "kvx" between ahead blocks)."""

    def _start_ahead(self, nxt: Block, decode_steps: int) -> AheadPrefill | None:
        """Block `nxt`'s ahead prefill over `decode_steps` passes, or None where it cannot run ahead (the
        policy says not to, a pipeline stage, or the budgets cannot hold it)."""
        if not self.policy.prefill_ahead or self.stage is not None:
            return None
        prompts, max_new_tokens, select = nxt
        batches = self._batches(prompts, max_new_tokens)
        reserve_positions(self.family, max(b.length for b in batches), self.device, self.dtype)
        per_pass = rows_per_pass(len(prompts), decode_steps)
        tag = "kvx" if self._host_tag == "kv" else "kv"
        work = self._ahead_bytes(batches, per_pass)
        self._plan_buffers(ahead=(self._shape(batches, max(max_new_tokens)), tag))
        try:
            self.budget.reserve(Tier.GPU, work, "working memory of the ahead prefill")
            self._ahead_work = work
            state = self._block_state(batches, select, host=tag, park=True)
            prefixes = self._ahead_prefixes(state)
        except BudgetExceeded as err:
            self._drop_ahead()
            log.info("the next block runs its own prefill: %s", err)
            return None
        self._next_tag = tag
        return AheadPrefill(state, per_pass, self.prefill_chunk_tokens, prefixes)

    def _ahead_prefixes(self, state: BlockState) -> PrefixKV:
        """The shared prefixes' keys/values [1, nkv, L, hd] for an ahead prefill, per (attention layer j, GPU
        batch k with a prefix): device buffers `kvpark.{j}.{k}.prefix`, the very ones a parked home that holds
        its prefix once uses (`KVHome(park_key=...)`); a home that holds the prefix in every row leaves them to
        the passes alone."""
        c, out = self.config, {}
        for j, k in state.kv:
            L = state.batches[k].prefix_len
            if L:
                shape = (1, c.num_key_value_heads, L, c.head_dim)
                out[(j, k)] = (self.arena.get(f"kvpark.{j}.{k}.prefix.k", Tier.GPU, shape, self.dtype),
                               self.arena.get(f"kvpark.{j}.{k}.prefix.v", Tier.GPU, shape, self.dtype))
        return out

    def _ahead_bytes(self, batches: list[GpuBatch], per_pass: int) -> int:
        """Device working memory of one ahead pass (`per_pass` rows of the longest batch; every cache
        segment's new keys/values staged for their store, the gpu share being parked)."""
        c, cc = self.config, self.cquant is not None
        staged = staged_kv_heads(c.num_key_value_heads, 0.0, 1.0, self.device.type, cc)
        return max(working_bytes(c, min(per_pass, b.size), b.prompt_len, b.length, self.dtype, cc, staged,
                                 self.prefill_chunk_tokens, self.decode_chunk_bytes, b.prefix_len,
                                 self.layout.experts) for b in batches)

    def _switch(self) -> BlockState | None:
        """After a block: the next block's state if its prefill ran ahead (its gpu cache moved to the device)."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        with torch.inference_mode():
            try:
                state = ahead.finish()
            finally:
                self._release_ahead_work()
        self._host_tag = self._next_tag
        return state

    def _drop_ahead(self) -> None:
        """Abandon an ahead prefill (an error, or budgets that cannot hold it): its stores settled, its
        reservation and parked/alternate host homes given back."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            for kv in ahead.state.kv.values():
                kv.settle()
        self._release_ahead_work()
        self.arena.drop(("kvpark.", "kvx." if self._host_tag == "kv" else "kv."), keep_tier=Tier.GPU)

    def _release_ahead_work(self) -> None:
        if self._ahead_work:
            self.budget.release(Tier.GPU, self._ahead_work, "working memory of the ahead prefill")
            self._ahead_work = 0

    def _ahead_layer(self, a: Action) -> None:
        """The ahead prefill's layer a.j on the weights block a.i loaded for it (after the block's last GPU
        batch's compute of that layer, so the weights' buffers are still theirs)."""
        if self.ahead.current is None and (a.j != 0 or not self.ahead.passes):
            return
        prof, clock = self.profiler, self.transfers.clock
        if prof is not None:
            prof.begin(a)
        if clock is not None:
            clock.compute_start("ahead")
        w = self._weights_for(a.i, a.j)
        self.ahead.layer(a.j, self.specs[a.j], w, self.config, self.family, self.transfers,
                         last=a.j == len(self.specs) - 1)
        if clock is not None:
            clock.compute_end()
        if prof is not None:
            prof.lap("ahead")
            prof.end()
