"""The one executor: runs a block of prompts through the block schedule on the placed tensors.

`Executor` owns every tensor of a run: weight homes (`WeightHomes`), KV-cache homes (`KVHome`), buffers
(`Arena`, counted against the hard gpu/cpu budgets) and the transfer channels (`Transfers`). One loop
consumes `block_schedule`'s actions; overlap on/off, debugging and timing are flags and hooks on that loop.
Indices: i step (0 = prefill), j layer (embed, attention/mlp per decoder layer, head), k GPU batch.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from engine.models.layers import causal_mask, window_keep
from engine.policy.policy import Policy
from engine.quant.config import CACHE_QUANT, WEIGHT_QUANT, QuantConfig
from engine.runtime.act_homes import ActHomes
from engine.runtime.arena import Arena
from engine.runtime.attention import prefill_attention
from engine.runtime.batch import GpuBatch
from engine.runtime.kv_cache import KVHome, StagingClaims
from engine.runtime.schedule import Action, block_schedule
from engine.runtime.selector import TokenSelector
from engine.runtime.transfers import Pending, Transfers
from engine.runtime.weight_homes import WeightHomes
from engine.runtime.working import working_bytes
from engine.storage.tiers import MemoryBudget, Tier

_MIN_SHARED_PREFIX = 4   # a GPU batch's common leading tokens are computed once when at least this many
# schedule verb -> method name (looked up per action: a dict of bound methods would make the executor a
# reference cycle, so its device tensors would outlive `close()` until the cyclic GC happened to run)
_VERBS = {verb: f"_{verb}" for verb in
          ("load_weight", "load_cache", "load_hidden", "store_cache", "store_hidden", "compute", "sync")}


class Executor:
    """Runs blocks for one loaded model under one policy. Not thread-safe; `close()` frees everything.

    `on_action(action)` (optional hook) is called before each schedule action; `stats` holds the last
    block's `prefill_s`, `decode_s` (wall clock; the device is synchronized at step ends only when
    `timing` is True) and `steps`, and `step_s` its seconds per step (index 0 the prefill). `quant_config`
    is the weights' compression when the policy compresses weights, `cache_quant_config` the KV cache's when
    it compresses the cache (defaults in engine.quant.config)."""

    def __init__(self, loaded, policy: Policy, *, device: torch.device, dtype: torch.dtype,
                 gpu_memory: int | None = None, cpu_memory: int | None = None, disk_dir: Path | None = None,
                 quant_config: QuantConfig = WEIGHT_QUANT, cache_quant_config: QuantConfig = CACHE_QUANT):
        self.loaded, self.policy = loaded, policy
        self.config, self.family = loaded.config, loaded.family
        self.device, self.dtype = torch.device(device), dtype
        self.specs = self.family.layer_specs()
        self.budget = MemoryBudget({Tier.GPU: gpu_memory, Tier.CPU: cpu_memory, Tier.DISK: None})
        self.arena = Arena(self.device, self.budget, Path(disk_dir) if disk_dir is not None else None)
        self.transfers = Transfers(self.device, policy.overlap)
        self.wquant = quant_config if policy.compress_weights else None
        self.cquant = cache_quant_config if policy.compress_cache else None
        self.on_action: Callable[[Action], None] | None = None
        self.timing = False
        self.stats: dict[str, float] = {}
        self.step_s: list[float] = []
        try:
            with torch.inference_mode():
                self.weights = WeightHomes(loaded, self.specs, w_gpu=policy.w_gpu, w_cpu=policy.w_cpu, dtype=dtype,
                                           quant=self.wquant, arena=self.arena, disk_dir=disk_dir)
        except BaseException:
            self.close()
            raise

    # ---- the block ------------------------------------------------------------------------------------
    def generate_block(self, prompts: list[list[int]], max_new_tokens: list[int], select: TokenSelector) -> None:
        """Run prefill + decode for one block (len(prompts) <= policy.block_size, rows sorted by length).

        Rows are cut into GPU batches of policy.gpu_batch_size in order. After every step, each GPU batch's
        alive rows' logits go to `select(rows, logits)`; a row ends when the selector says finished or when
        it has produced its own max_new_tokens. Returns when every row has ended; results live in `select`.
        """
        p = self.policy
        if len(prompts) > p.block_size:
            raise ValueError(f"generate_block: {len(prompts)} prompts exceed the policy's block size {p.block_size}")
        if len(prompts) != len(max_new_tokens):
            raise ValueError(f"generate_block: {len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens")
        if not prompts:
            return
        for r, (prompt, n) in enumerate(zip(prompts, max_new_tokens)):
            if not prompt or n < 1:
                raise ValueError(f"generate_block: row {r} has an empty prompt or max_new_tokens < 1")
        with torch.inference_mode():
            self._run_block(prompts, max_new_tokens, select)

    def _run_block(self, prompts, max_new_tokens, select) -> None:
        p, c = self.policy, self.config
        gbs = p.gpu_batch_size
        self.select = select
        self.batches = [
            GpuBatch(list(range(s, min(s + gbs, len(prompts)))), prompts[s:s + gbs], max_new_tokens[s:s + gbs],
                     self.device, pad_id=c.pad_token_id or 0, min_prefix=_MIN_SHARED_PREFIX)
            for s in range(0, len(prompts), gbs)
        ]
        K, J = len(self.batches), len(self.specs)
        work = max(working_bytes(c, b.size, b.prompt_len, b.length, self.dtype, self.cquant is not None)
                   for b in self.batches)
        self.budget.reserve(Tier.GPU, work, "working memory of one GPU batch")
        try:
            self.kv = {
                (j, k): KVHome(self.arena, f"kv.{j}.{k}", rows=b.size, length=b.length,
                               num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=self.dtype,
                               cache_gpu=p.cache_gpu, cache_cpu=p.cache_cpu, quant=self.cquant,
                               cpu_attention=p.cpu_attention)
                for j, spec in enumerate(self.specs) if spec.kind == "attention"
                for k, b in enumerate(self.batches)
            }
            self.acts = ActHomes(self.arena, p.act_gpu, p.act_cpu, K)
            self.hidden: list[torch.Tensor | None] = [None] * K
            self._inflight: list[Pending] = []
            self._claims = StagingClaims()
            self._stores = 0
            self._wpend: dict[tuple[int, int], list[Pending]] = {}
            self._cpend: dict[tuple[int, int, int], list[Pending]] = {}
            self._w: tuple[int, int, dict] | None = None
            self._t0 = time.perf_counter()
            self.stats = {"prefill_s": 0.0, "decode_s": 0.0, "steps": 0}
            self.step_s = []
            num_steps = max(max_new_tokens)
            skip = self._noop_verbs()
            for action in block_schedule(num_steps, J, K, paged=K > 1):
                if action.verb == "compute" and action.j == 0 and action.k == 0 and self._all_done():
                    break
                if self.on_action is not None:
                    self.on_action(action)
                if action.verb not in skip:
                    getattr(self, _VERBS[action.verb])(action)
            self._sync(None)
        finally:
            self._drain()
            self.budget.release(Tier.GPU, work, "working memory of one GPU batch")
            self._drop_block_state()

    def _drop_block_state(self) -> None:
        """Drop every reference into a block's buffers (pending transfers' closures hold cache views), so the
        next block's homes are never allocated while this block's are still alive."""
        self.kv, self.batches, self.hidden = {}, [], []
        self._wpend, self._cpend, self._w, self._inflight = {}, {}, None, []
        self._claims = StagingClaims()

    def _noop_verbs(self) -> frozenset[str]:
        """Verbs that move nothing under this policy (skipped without a call: host time is decode time)."""
        p, skip = self.policy, set()
        if self.weights.all_direct:
            skip.add("load_weight")
        if p.cache_gpu >= 1.0:
            skip |= {"load_cache", "store_cache"}
        if not self.acts.active:
            skip |= {"load_hidden", "store_hidden"}
        return frozenset(skip)

    def _all_done(self) -> bool:
        return all(b.done for b in self.batches)

    def _slot(self, i: int, j: int, k: int) -> int:
        return ((i * len(self.specs) + j) * len(self.batches) + k) % 2

    def _track(self, pendings: list[Pending]) -> list[Pending]:
        self._inflight.extend(pendings)
        return pendings

    # ---- actions --------------------------------------------------------------------------------------
    def _load_weight(self, a: Action) -> None:
        slot = (a.i * len(self.specs) + a.j) % 2
        pend = self.weights.load(a.j, slot, a.page, a.pages, self.transfers)
        self._wpend.setdefault((a.i, a.j), []).extend(self._track(pend))

    def _load_cache(self, a: Action) -> None:
        kv = self.kv.get((a.j, a.k))
        if kv is None or a.i == 0 or self.batches[a.k].done:
            return
        self._cpend[(a.i, a.j, a.k)] = self._track(kv.load(self.transfers, self._slot(a.i, a.j, a.k)))

    def _store_cache(self, a: Action) -> None:
        kv = self.kv.get((a.j, a.k))
        if kv is not None:
            # staging buffers alternate per store, so a store waits for the one two stores back (keyed by
            # the slot's parity, every attention layer of a one-GPU-batch step would share one buffer and
            # each store would wait for the previous layer's: the host could run at most a layer ahead)
            kv.store(self.transfers, self._stores % 2, self._claims)
            self._stores += 1

    def _load_hidden(self, a: Action) -> None:
        if self.batches[a.k].done:
            return
        self.hidden[a.k] = self.acts.load(a.k, self.hidden[a.k], self.transfers)

    def _store_hidden(self, a: Action) -> None:
        if self.hidden[a.k] is not None and not self.batches[a.k].done:
            self.hidden[a.k] = self.acts.store(a.k, self.hidden[a.k], self.transfers)

    def _sync(self, a: Action | None) -> None:
        for pending in self._inflight:
            pending.wait()
        self._inflight = []

    def _drain(self) -> None:
        for pending in getattr(self, "_inflight", []):
            pending.wait()
        self._inflight = []
        for kv in getattr(self, "kv", {}).values():
            kv.settle()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _weights_for(self, i: int, j: int) -> dict[str, torch.Tensor]:
        if self._w is None or self._w[:2] != (i, j):
            for pending in self._wpend.pop((i, j), []):
                pending.wait()
            self._w = (i, j, self.weights.get(j, (i * len(self.specs) + j) % 2))
        return self._w[2]

    def _compute(self, a: Action) -> None:
        batch = self.batches[a.k]
        if batch.done:
            return
        for pending in self._cpend.pop((a.i, a.j, a.k), []):
            pending.wait()
        self.hidden[a.k] = self.acts.ready(a.k, self.hidden[a.k])
        spec = self.specs[a.j]
        w = self._weights_for(a.i, a.j)
        f = self.family
        x = self.hidden[a.k]
        if spec.kind == "embed":
            x = f.embed(w, batch.input_ids, batch.positions)                               # [b, s, h]
            if batch.prefill and batch.prefix_len:
                x = (f.embed(w, batch.prefix_ids, batch.prefix_positions), x)              # ([1, L, h], [b, s, h])
            self.hidden[a.k] = x
        elif spec.kind == "attention":
            kv = self.kv[(a.j, a.k)]
            if isinstance(x, tuple):
                self.hidden[a.k] = self._attention_with_prefix(w, kv, batch, spec.index, *x)
            else:
                self.hidden[a.k] = self._attention(w, kv, batch, spec.index, x)
        elif spec.kind == "mlp":
            self.hidden[a.k] = tuple(f.mlp(w, h) for h in x) if isinstance(x, tuple) else f.mlp(w, x)
        else:
            self._head(w, batch, a)

    def _attention(self, w, kv: KVHome, batch: GpuBatch, layer: int, x: torch.Tensor) -> torch.Tensor:
        c, f = self.config, self.family
        b, s, _ = x.shape
        window, cap = c.layer_window(layer), c.attn_logit_softcapping
        q, k, v = f.attn_qkv(w, x, batch.positions, layer)                                 # [b, nh|nkv, s, hd]
        if batch.prefill:
            mask = causal_mask(batch.key_valid[:, :s], s)                                  # [b, 1, s, s]
            if window is not None:
                mask = mask & window_keep(batch.key_valid[:, :s], s, window)
            out = kv.prefill(q, k, v, mask, c.attn_scale, cap)                             # [b, nh, s, hd]
        else:
            t = batch.t
            valid, valid_host = batch.key_valid[:, :t + 1], batch.key_valid_host[:, :t + 1]   # [b, t+1]
            if window is not None:
                valid = valid & window_keep(valid, 1, window)[:, 0, 0]
                valid_host = valid_host & window_keep(valid_host, 1, window)[:, 0, 0]
            out = kv.decode(q, k, v, t, valid, valid_host, c.attn_scale, cap)              # [b, nh, 1, hd]
        attn = out.transpose(1, 2).reshape(b, s, c.num_attention_heads * c.head_dim)       # [b, s, nh*hd]
        return f.attn_out(w, attn, x)                                                      # [b, s, h]

    def _attention_with_prefix(self, w, kv: KVHome, batch: GpuBatch, layer: int, px: torch.Tensor,
                               x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill of a batch whose rows share a prefix: the prefix [1, L] attends causally to itself once;
        the suffixes [b, s] attend to the prefix's keys (broadcast) and causally to their own."""
        c, f = self.config, self.family
        L, (b, s, _) = px.shape[1], x.shape
        window, cap = c.layer_window(layer), c.attn_logit_softcapping
        pq, pk, pv = f.attn_qkv(w, px, batch.prefix_positions, layer)                      # [1, nh|nkv, L, hd]
        ones = torch.ones(1, L, dtype=torch.bool, device=px.device)
        pmask = causal_mask(ones, L)                                                       # [1, 1, L, L]
        if window is not None:
            pmask = pmask & window_keep(ones, L, window)
        pout = prefill_attention(pq, pk, pv, pmask, c.attn_scale, cap)                     # [1, nh, L, hd]
        px = f.attn_out(w, pout.transpose(1, 2).reshape(1, L, -1), px)                     # [1, L, h]
        q, k, v = f.attn_qkv(w, x, batch.positions, layer)                                 # [b, nh|nkv, s, hd]
        k = torch.cat((pk.expand(b, -1, -1, -1), k), dim=2)                                # [b, nkv, L+s, hd]
        v = torch.cat((pv.expand(b, -1, -1, -1), v), dim=2)
        own = causal_mask(batch.key_valid[:, L:L + s], s)                                  # [b, 1, s, s]
        mask = torch.cat((own.new_ones(b, 1, s, L), own), dim=-1)                          # [b, 1, s, L+s]
        if window is not None:
            mask = mask & window_keep(batch.key_valid[:, :L + s], s, window)
        out = kv.prefill(q, k, v, mask, c.attn_scale, cap)                                 # [b, nh, s, hd]
        attn = out.transpose(1, 2).reshape(b, s, c.num_attention_heads * c.head_dim)       # [b, s, nh*hd]
        return px, f.attn_out(w, attn, x)

    def _head(self, w, batch: GpuBatch, a: Action) -> None:
        x = self.hidden[a.k]
        x = x[1] if isinstance(x, tuple) else x
        s = x.shape[1]
        logits = self.family.head(w, x[:, -1])                                             # [b, v] float32
        batch.advance(batch.prompt_len if batch.prefill else s)
        live = batch.live_index()
        rows = [batch.rows[r] for r in live]
        if len(live) < batch.size:
            logits = logits[torch.tensor(live, device=logits.device)]                     # [live, v]
        tokens, finished = self.select(rows, logits)
        picked: dict[int, int] = {}
        for r, tok, fin in zip(live, tokens, finished):
            batch.generated[r] += 1
            if fin or batch.generated[r] >= batch.max_new[r]:
                batch.finish(r)
            else:
                picked[r] = int(tok)
        batch.set_next(picked)
        self.hidden[a.k] = None
        keep = batch.compact_index()
        if keep is not None and keep.numel() > 0:
            for (j, k), kv in self.kv.items():
                if k == a.k:
                    kv.compact(keep)
            batch.compact(keep)
        if a.k == len(self.batches) - 1:
            self._step_done(a.i)

    def _step_done(self, i: int) -> None:
        if self.timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.stats["prefill_s" if i == 0 else "decode_s"] += now - self._t0
        self.step_s.append(now - self._t0)
        self.stats["steps"] = i + 1
        self._t0 = now

    # ---- teardown -------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, dict[str, int | None]]:
        """Bytes held now / peak / budget per tier, as counted by the executor."""
        return {t.value: {"used": self.budget.used[t], "peak": self.budget.peak[t], "budget": self.budget.limits.get(t)}
                for t in Tier}

    def close(self) -> None:
        """Free every buffer and file of this executor (idempotent): afterwards it holds no tensor, so the
        device memory is back in torch's allocator at once, whoever still references the executor."""
        self.transfers.close()
        self._drop_block_state()
        self.weights = self.select = self.on_action = None
        self.arena.close()
