"""The one executor: runs a block of prompts through the block schedule on the placed tensors.

`Executor` owns every tensor of a run: weight homes (`WeightHomes`), KV-cache homes (`KVHome`), buffers
(`Arena`, counted against the hard gpu/cpu budgets) and the transfer channels (`Transfers`). Every buffer comes
from the arena by name, out of the buffer plan the executor gives it at every block start (`_plan_buffers`:
`engine.policy.buffers.buffer_plan` of its model layout, policy and the block it runs, the plan the memory
model sums). One loop consumes `block_schedule`'s actions; overlap on/off, debugging and timing are flags and
hooks on that loop.
What one block holds (rows, cache homes, hidden states, pending transfers) is one `BlockState`, made at block
start and dropped at its end; the attention layer itself is `engine.models.attention.attention_layer`.
MoE models run `moe_block_schedule` (paged weights; with `policy.pipeline` and CPU attention, CGOPipe: a
decode attention's host part runs on `HostAttention`'s thread and is joined before the MoE layer; with
`policy.pipeline`, the next step's first cache loads cross the link while a step's heads pick tokens).
Indices: i step (0 = prefill), j layer (embed, attention/mlp per decoder layer, head), k GPU batch.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch

from engine.models.attention import attention_layer, attention_output, decode_inputs
from engine.models.cpu_linear import INT4_DENSE_MAX_ROWS, INT4_MAX_ROWS
from engine.models.layers import reserve_positions
from engine.models.weights import weight_quant
from engine.policy.buffer_spec import BatchShape, BlockShape, BufferPlan
from engine.policy.buffers import buffer_plan, decode_stage_slots, pipelines_host_attention, weight_copies, weight_homes
from engine.policy.partition import Stage
from engine.policy.policy import Policy
from engine.policy.prefix import MIN_SHARED_PREFIX, prefix_held_once
from engine.policy.working import (
    DECODE_CHUNK_BYTES, PREFILL_CHUNK_TOKENS, row_chunks, staged_kv_heads, working_bytes,
)
from engine.quant.config import CACHE_QUANT, QuantConfig
from engine.runtime.act_homes import ActHomes
from engine.runtime.ahead import AheadPrefill
from engine.runtime.arena import Arena
from engine.runtime.batch import GpuBatch
from engine.runtime.block_state import AttentionInFlight, Block, BlockState, StepResult
from engine.runtime.executor_ahead import AheadDriver
from engine.runtime.host_attention import HostAttention
from engine.runtime.kv_buffers import BufferReleases
from engine.runtime.kv_cache import KVHome
from engine.runtime.layout import model_layout
from engine.runtime.moe_schedule import moe_block_schedule, previous_of_kind
from engine.runtime.prefill_chunks import attention_prefill, mlp_prefill
from engine.runtime.schedule import Action, block_schedule
from engine.runtime.selector import TokenSelector, end_step
from engine.runtime.step_profile import StepProfile
from engine.runtime.transfers import Pending, Transfers
from engine.runtime.weight_homes import WeightHomes
from engine.storage.tiers import MemoryBudget, Tier

# schedule verb -> method name (looked up per action: a dict of bound methods would make the executor a
# reference cycle, so its device tensors would outlive `close()` until the cyclic GC happened to run)
_VERBS = {verb: f"_{verb}" for verb in
          ("load_weight", "load_cache", "load_hidden", "store_cache", "store_hidden", "compute", "sync",
           "join_attention", "prefetch_weight", "prefetch_cache")}


class Executor(AheadDriver):
    """Runs blocks for one loaded model under one policy. Not thread-safe; `close()` frees everything.

    `on_action(action)` (optional hook) is called before each schedule action; `stats` holds the last
    block's `prefill_s`, `decode_s` (wall clock from one step's last token pick to the next: a pick
    synchronizes the compute stream, never the device) and `steps`, and `step_s` its seconds per step (index 0
    the prefill). `profiler` (a `StepProfile`, optional) is told of every action and of the seams inside a
    compute (`step_profile`); `transfers.clock` (a `StepClock`, optional, CUDA) gets every step as the device
    saw it without synchronizing anything (`step_clock`). `quant_config`
    is the weights' compression when the policy compresses weights (None: the model's, `weight_quant`: what
    the memory model counts), `cache_quant_config` the KV cache's when it compresses the cache (defaults in
    engine.quant.config). A prefill runs each layer over row chunks of
    about `prefill_chunk_tokens` tokens, and decode over a compressed device cache runs the fused kernel
    (`engine.models.quant_decode`) or, where it does not apply, dequantizes `decode_chunk_bytes` at a time
    (`engine.policy.working`; the defaults are what the memory model assumes).
    `stage` (optional, `engine.policy.partition.Stage`): run only that pipeline stage's layers (its weights are
    the only ones placed); `engine.runtime.stage_executor` drives such an executor step by step. The ahead
    prefill's methods are `AheadDriver`'s (`engine.runtime.executor_ahead`). On a CPU the family's
    `LINEAR_WEIGHTS` are held packed (`engine.models.cpu_linear`), compressed ones running the int4 kernel
    for up to `int4_max_rows` rows, or with `Policy.cpu_dense_copy` up to `int4_dense_max_rows` (past them a
    dense copy multiplies; another device refuses that policy)."""

    def __init__(self, loaded, policy: Policy, *, device: torch.device, dtype: torch.dtype,
                 gpu_memory: int | None = None, cpu_memory: int | None = None, disk_dir: Path | None = None,
                 quant_config: QuantConfig | None = None, cache_quant_config: QuantConfig = CACHE_QUANT,
                 prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS, decode_chunk_bytes: int = DECODE_CHUNK_BYTES,
                 stage: Stage | None = None, int4_max_rows: int = INT4_MAX_ROWS,
                 int4_dense_max_rows: int = INT4_DENSE_MAX_ROWS):
        if policy.cpu_dense_copy and torch.device(device).type != "cpu":
            raise ValueError(f"Policy.cpu_dense_copy is a CPU run's weight form; this executor runs on {device}")
        self.loaded, self.policy = loaded, policy
        self.config, self.family = loaded.config, loaded.family
        self.device, self.dtype = torch.device(device), dtype
        self.specs = [sp for sp in self.family.layer_specs() if stage is None or stage.holds(sp.kind, sp.index)]
        self.wquant = (quant_config or weight_quant(self.config)) if policy.compress_weights else None
        self.layout = model_layout(self.config, dtype, policy.compress_weights, specs=self.specs, quant=quant_config)
        self.slots = self.layout.slots
        self.budget = MemoryBudget({Tier.GPU: gpu_memory, Tier.CPU: cpu_memory, Tier.DISK: None})
        self.arena = Arena(self.device, self.budget, Path(disk_dir) if disk_dir is not None else None)
        self.transfers = Transfers(self.device, policy.overlap)
        self.host_attention = HostAttention(self.arena, self.transfers)
        self.pipelined = pipelines_host_attention(self.config, policy)
        self.cquant = cache_quant_config if policy.compress_cache else None
        self.prefill_chunk_tokens, self.decode_chunk_bytes = prefill_chunk_tokens, decode_chunk_bytes
        self.on_action: Callable[[Action], None] | None = None
        self.profiler: StepProfile | None = None
        self.stats: dict[str, float] = {}
        self.step_s: list[float] = []
        self.block: BlockState | None = None     # the running block's state (None between blocks)
        self.stage = stage
        self.ahead: AheadPrefill | None = None   # the next block's prefill riding on this block's decode
        self._running: list[tuple[BlockShape, str]] = []   # the blocks whose buffers the plan holds
        self._ahead_work = 0                     # its reserved device working memory
        self._host_tag = self._next_tag = "kv"   # host cache homes alternate kv / kvx between ahead blocks
        self.kv_releases = BufferReleases()      # when each device cache buffer was last read
        # the weights' homes, and their copies: a CPU run's int4 weights take their dense copy at placement
        self.plan = BufferPlan((*weight_homes(self.layout, policy, self.device.type),
                                *weight_copies(self.layout, policy, self.device.type)))
        self.arena.plan(self.plan)
        try:
            with torch.inference_mode():
                self.weights = WeightHomes(loaded, self.specs, dtype=dtype, quant=self.wquant, arena=self.arena,
                                           disk_dir=disk_dir, ahead=self.slots.ahead,
                                           packed=getattr(self.family, "LINEAR_WEIGHTS", frozenset()),
                                           int4_max_rows=int4_dense_max_rows if policy.cpu_dense_copy
                                           else int4_max_rows, dense=policy.cpu_dense_copy)
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
        if not prompts:
            return
        for _ in self.generate_blocks([(prompts, max_new_tokens, select)]):
            pass

    def generate_blocks(self, blocks: Iterable[Block]) -> Iterator[int]:
        """Run `blocks` ((prompts, max_new_tokens, select) each, as `generate_block` takes) in order, yielding
        each one's index once its rows have all ended (its results are then in its selector). Block n + 1
        is taken from `blocks` before block n runs: with `policy.prefill_ahead` its prefill runs on block n's
        decode steps (`engine.runtime.ahead`) where it can (block n decodes at least one step, the budgets hold
        its chunk and its parked cache; a shared prefix is computed once per GPU batch there too); otherwise
        it runs its own prefill."""
        it = iter(blocks)
        nxt, n, ready = self._take(it, 0), 0, None
        while nxt is not None:
            cur, nxt = nxt, self._take(it, n + 1)
            with torch.inference_mode():
                ready = self._run_block(*cur, ready, nxt)
            yield n
            n += 1

    def _take(self, it: Iterator[Block], n: int) -> Block | None:
        """The next block of `it`, checked (None when there is none)."""
        block = next(it, None)
        if block is None:
            return None
        prompts, max_new_tokens, select = block
        p = self.policy
        where = f"generate_block: block {n}: " if n else "generate_block: "
        if not prompts:
            raise ValueError(f"{where}no prompts")
        if len(prompts) > p.block_size:
            raise ValueError(f"{where}{len(prompts)} prompts exceed the policy's block size {p.block_size}")
        if len(prompts) != len(max_new_tokens):
            raise ValueError(f"{where}{len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens")
        for r, (prompt, m) in enumerate(zip(prompts, max_new_tokens)):
            if not prompt or m < 1:
                raise ValueError(f"{where}row {r} has an empty prompt or max_new_tokens < 1")
        return list(prompts), list(max_new_tokens), select

    def _run_block(self, prompts, max_new_tokens, select, ready: BlockState | None,
                   nxt: Block | None) -> BlockState | None:
        """One block: its own prefill, or (`ready`) the state its ahead prefill left; with `nxt`, that block's
        prefill ahead where it can. Returns the next block's state when its prefill ran ahead."""
        batches = ready.batches if ready is not None else self._batches(prompts, max_new_tokens)
        num_steps = max(max_new_tokens)
        self._running = [(self._shape(batches, num_steps, 1 if ready is not None else 0), "")]
        self._plan_buffers()
        reserve_positions(self.family, max(b.length for b in batches), self.device, self.dtype)
        work = self._working_bytes(batches)
        self.budget.reserve(Tier.GPU, work, "working memory of one GPU batch")
        try:
            self.block = ready if ready is not None else self._block_state(batches, select)
            self.block.t0 = time.perf_counter()
            self.stats = {"prefill_s": 0.0, "decode_s": 0.0, "steps": 1 if ready is not None else 0,
                          "prefill_ahead": float(ready is not None)}
            self.step_s = []
            if nxt is not None and num_steps > 1:
                self.ahead = self._start_ahead(nxt, num_steps - 1)
            # the ahead's passes fit the block's decode steps (`rows_per_pass`), and a block whose rows all
            # ended keeps streaming weight passes until the ahead is idle (`_run_actions`)
            self._run_actions(self._schedule(num_steps, len(batches), 1 if ready is not None else 0))
            self._sync(None)
            if self.profiler is not None:
                self.profiler.finish()
        except BaseException:
            self._drop_ahead()
            raise
        finally:
            self._drain()
            self.budget.release(Tier.GPU, work, "working memory of one GPU batch")
            self._drop_block_state()
        return self._switch()

    def _batches(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[GpuBatch]:
        """The block's rows cut into GPU batches of policy.gpu_batch_size, in order."""
        gbs, c = self.policy.gpu_batch_size, self.config
        return [
            GpuBatch(list(range(s, min(s + gbs, len(prompts)))), prompts[s:s + gbs], max_new_tokens[s:s + gbs],
                     self.device, pad_id=c.pad_token_id or 0, min_prefix=MIN_SHARED_PREFIX)
            for s in range(0, len(prompts), gbs)
        ]

    @staticmethod
    def _shape(batches: Sequence[GpuBatch], steps: int, first: int = 0) -> BlockShape:
        """The buffer plan's view of a block of `batches` running steps [first, steps)."""
        return BlockShape(tuple(BatchShape(b.size, b.prompt_len, b.length, b.prefix_len) for b in batches), steps,
                          first)

    def _plan_buffers(self, ahead: tuple[BlockShape, str] | None = None) -> None:
        """Give the arena the plan of what runs now: the weights' buffers, each running block's (`_running`:
        (shape, tag) as `_block_state` names its homes) and, with `ahead` ((shape, host name)), the buffers of
        that next block's prefill run on the first running block's decode steps."""
        p, dev = self.policy, self.device.type
        policy = p if self.pipelined or not p.pipeline else replace(p, pipeline=False)   # host attention in line
        plan = BufferPlan(tuple(weight_homes(self.layout, p, dev)))
        for n, (shape, tag) in enumerate(self._running):
            plan = plan + buffer_plan(self.config, self.layout, policy, shape, dev,
                                      ahead=ahead[0] if ahead is not None and n == 0 else None,
                                      cache_quant=self.cquant, chunk_tokens=self.prefill_chunk_tokens,
                                      host=self._host_tag, next_host=ahead[1] if ahead is not None else "kvx",
                                      tag=tag)
        self.plan = plan
        self.arena.plan(plan)

    def _working_bytes(self, batches: list[GpuBatch]) -> int:
        """Device working memory of the largest GPU batch (the memory model's count)."""
        p, c = self.policy, self.config
        cc = self.cquant is not None
        staged = staged_kv_heads(c.num_key_value_heads, p.cache_gpu, p.cache_cpu, self.device.type, cc)
        return max(working_bytes(c, b.size, b.prompt_len, b.length, self.dtype, cc, staged, self.prefill_chunk_tokens,
                                 self.decode_chunk_bytes, b.prefix_len, self.layout.experts) for b in batches)

    def _block_state(self, batches: list[GpuBatch], select: TokenSelector, tag: str = "", host: str | None = None,
                     park: bool = False) -> BlockState:
        """A block's state: its cache homes (`kv{tag}.{j}.{k}` in the arena on the gpu, `{host}{tag}.{j}.{k}`
        on the host, `host` default the running host tag; `park`: gpu segments parked as `kvpark.{j}.{k}`, for
        an ahead prefill) and activation homes."""
        p, c = self.policy, self.config
        once = prefix_held_once(self.device.type, self.cquant is not None)
        host = f"{self._host_tag if host is None else host}{tag}"
        kv = {
            (j, k): KVHome(self.arena, f"kv{tag}.{j}.{k}", rows=b.size, length=b.length,
                           num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=self.dtype,
                           cache_gpu=p.cache_gpu, cache_cpu=p.cache_cpu, quant=self.cquant,
                           cpu_attention=p.cpu_attention, decode_chunk_bytes=self.decode_chunk_bytes,
                           prefix_len=b.prefix_len if once else 0, host_key=f"{host}.{j}.{k}",
                           park_key=f"kvpark.{j}.{k}" if park else None, releases=self.kv_releases)
            for j, spec in enumerate(self.specs) if spec.kind == "attention"
            for k, b in enumerate(batches)
        }
        return BlockState(select, batches, kv, ActHomes(self.arena, p.act_gpu, p.act_cpu, len(batches)),
                          [None] * len(batches))

    def _run_actions(self, actions: Iterable[Action]) -> None:
        """The one loop: every action of `actions` on `self.block`, until its rows have all ended."""
        skip = self._noop_verbs()
        last_k = len(self.block.batches) - 1
        for action in actions:
            if action.verb == "compute" and action.j == 0 and action.k == 0 and self.block.all_done and (
                    self.ahead is None or self.ahead.idle):
                break
            if self.on_action is not None:
                self.on_action(action)
            if action.verb not in skip:
                prof, clock = self.profiler, self.transfers.clock
                if clock is not None:
                    clock.compute_start("compute" if action.verb == "compute" else "other", action.verb)
                if prof is None:
                    getattr(self, _VERBS[action.verb])(action)
                else:
                    prof.begin(action)
                    getattr(self, _VERBS[action.verb])(action)
                    prof.end()
                if clock is not None:
                    clock.compute_end()
            if action.verb == "compute" and action.k == last_k and action.i > 0 and self.ahead is not None:
                self._ahead_layer(action)

    def _schedule(self, num_steps: int, K: int, first: int = 0):
        """The block's actions for steps [first, num_steps): the MoE schedule for MoE models (pages: the
        policy's, one per GPU batch by default, one without `pipeline`; with `pipeline`, the experts loaded a
        layer of their kind ahead and the next step's first cache loads at a step's head), else the zig-zag
        with one page per GPU batch."""
        if not self.config.is_moe:
            return block_schedule(num_steps, len(self.specs), K, paged=K > 1, first=first)
        p = self.policy
        pages = (p.weight_pages or K) if p.pipeline else 1
        return moe_block_schedule(num_steps, [s.kind for s in self.specs], K, pages=pages, pipelined=self.pipelined,
                                  first=first, ahead=self.slots.ahead if p.pipeline else frozenset(),
                                  early_cache=p.pipeline)

    def _drop_block_state(self) -> None:
        """Drop every reference into a block's buffers (pending transfers' closures hold cache views), so the
        next block's homes are never allocated while this block's are still alive."""
        self.block = None

    def _noop_verbs(self) -> frozenset[str]:
        """Verbs that move nothing under this policy (skipped without a call: host time is decode time)."""
        p, skip = self.policy, set()
        if self.weights.all_direct:
            skip |= {"load_weight", "prefetch_weight"}
        if p.cache_gpu >= 1.0:
            skip |= {"load_cache", "store_cache", "prefetch_cache"}
        if not self.block.acts.active:
            skip |= {"load_hidden", "store_hidden"}
        return frozenset(skip)

    def _slot(self, i: int, j: int, k: int) -> int:
        """The double-buffer slot of GPU batch k's cache buffers for (step i, layer j)."""
        return ((i * len(self.specs) + j) * len(self.block.batches) + k) % 2

    def _weight_slot(self, i: int, j: int) -> int:
        """The buffer slot of layer j's weights at step i (`engine.policy.weight_slots`)."""
        return self.slots.slot(i, j)

    # ---- actions --------------------------------------------------------------------------------------
    def _issue_weight(self, a: Action) -> list:
        """Start page a.page of layer (a.i, a.j)'s weight load; its compute waits for it (`_weights_for`)."""
        pend = self.weights.load(a.j, self._weight_slot(a.i, a.j), a.page, a.pages, self.transfers)
        self.block.wpend.setdefault((a.i, a.j), []).extend(pend)
        return pend

    def _load_weight(self, a: Action) -> None:
        self.block.track(self._issue_weight(a))

    def _prefetch_weight(self, a: Action) -> None:
        """A load issued a layer of its kind ahead (`moe_block_schedule`): only its layer's compute waits for
        it (`_weights_for`), never the sync of the slot that issued it. It overwrites the compressed buffer of
        the previous layer of its kind, so that layer is dequantized first: done by the compute just before,
        unless that compute's GPU batch had ended (then here, and its next batch's compute reuses it)."""
        if a.page == 0:
            self._weights_for(*previous_of_kind(self.slots.kinds, a.i, a.j))
        self._issue_weight(a)

    def _load_cache(self, a: Action) -> None:
        self.block.track(self._issue_cache(a.i, a.j, a.k))

    def _prefetch_cache(self, a: Action) -> None:
        """A cache load issued at the previous step's head (`moe_block_schedule`): only its compute waits for
        it, never the sync of the slot that issued it (that would put the load in front of the heads)."""
        self._issue_cache(a.i, a.j, a.k)

    def _issue_cache(self, i: int, j: int, k: int) -> list[Pending]:
        """Start (i, j, k)'s cache load into its double-buffer slot; its compute waits for it (`cpend`)."""
        blk = self.block
        kv = blk.kv.get((j, k))
        if kv is None or i == 0 or blk.batches[k].done:
            return []
        pend = blk.cpend[(i, j, k)] = kv.load(self.transfers, self._slot(i, j, k))
        return pend

    def _store_cache(self, a: Action) -> None:
        blk = self.block
        kv = blk.kv.get((a.j, a.k))
        if kv is not None:
            # a store waits for the store that last used its staging buffer: the prefill's (large) buffers
            # alternate per store (keyed by the slot's parity, every attention layer of a one-GPU-batch step
            # would share one buffer), a decode step's (one position a row) take `decode_stage_slots` turns
            # so the compute thread can run that many stores ahead of the store thread
            slot = blk.stores % 2 if a.i == 0 else f"d{blk.stores % decode_stage_slots(len(blk.kv))}"
            kv.store(self.transfers, slot, blk.claims)
            blk.stores += 1

    def _load_hidden(self, a: Action) -> None:
        blk = self.block
        if blk.batches[a.k].done:
            return
        batch = blk.batches[a.k]
        blk.hidden[a.k] = blk.acts.load(a.k, blk.hidden[a.k], self.transfers,
                                        self._chunks(batch) if batch.prefill else ())

    def _store_hidden(self, a: Action) -> None:
        blk = self.block
        if blk.hidden[a.k] is not None and not blk.batches[a.k].done:
            blk.hidden[a.k] = blk.acts.store(a.k, blk.hidden[a.k], self.transfers)

    def _sync(self, a: Action | None) -> None:
        self.block.wait_inflight()

    def _join_attention(self, a: Action) -> None:
        blk = self.block
        flight = blk.hidden[a.k]
        if not blk.batches[a.k].done and isinstance(flight, AttentionInFlight):
            blk.hidden[a.k] = attention_output(self.config, self.family, flight.weights, flight.join.join(), flight.x)

    def _drain(self) -> None:
        """Wait for every transfer and host attention of the block (if one is running), the ahead prefill's
        stores, and the device."""
        self.host_attention.drain()
        if self.block is not None:
            self.block.wait_inflight()
            for pendings in (*self.block.wpend.values(), *self.block.cpend.values()):   # prefetched for
                for pending in pendings:                                                 # computes never run
                    pending.wait()
            for kv in self.block.kv.values():
                kv.settle()
        if self.ahead is not None:
            for kv in self.ahead.state.kv.values():
                kv.settle()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _weights_for(self, i: int, j: int) -> dict[str, torch.Tensor]:
        blk = self.block
        if blk.weights is None or blk.weights[:2] != (i, j):
            for pending in blk.wpend.pop((i, j), []):
                pending.wait()
            if self.profiler is not None:
                self.profiler.lap("weight_wait")
            blk.weights = (i, j, self.weights.get(j, self._weight_slot(i, j)))
        return blk.weights[2]

    def _compute(self, a: Action) -> None:
        blk = self.block
        batch = blk.batches[a.k]
        if batch.done:
            return
        prof = self.profiler
        for pending in blk.cpend.pop((a.i, a.j, a.k), []):
            pending.wait()
        x, upto = blk.acts.arriving(a.k, blk.hidden[a.k])
        blk.hidden[a.k] = x
        spec = self.specs[a.j]
        if not (batch.prefill and spec.kind in ("attention", "mlp")):
            upto(None)                                  # only the prefill's chunked layers read it by rows
        if prof is not None:
            prof.lap("cache_wait")
        w = self._weights_for(a.i, a.j)
        if prof is not None:
            prof.lap("dequant")
        f = self.family
        if spec.kind == "embed":
            x = f.embed(w, batch.input_ids, batch.positions)                               # [b, s, h]
            if batch.prefill and batch.prefix_len:
                x = (f.embed(w, batch.prefix_ids, batch.prefix_positions), x)              # ([1, L, h], [b, s, h])
            blk.hidden[a.k] = x
        elif spec.kind == "attention":
            kv = blk.kv[(a.j, a.k)]
            if batch.prefill:
                blk.hidden[a.k] = attention_prefill(self.config, f, w, kv, batch, spec.index, x, self._chunks(batch),
                                                    upto)
            elif self.pipelined:
                c, d = self.config, decode_inputs(self.config, f, w, batch, spec.index, x)
                join = kv.decode_start(d.q, d.k, d.v, d.t, d.valid, d.valid_host, c.attn_scale,
                                       c.attn_logit_softcapping, self.host_attention, f"hattn.{a.k}")
                blk.hidden[a.k] = AttentionInFlight(join, w, x)
            else:
                blk.hidden[a.k] = attention_layer(self.config, f, w, kv, batch, spec.index, x)
        elif spec.kind == "mlp":
            blk.hidden[a.k] = mlp_prefill(f, w, x, self._chunks(batch), batch, upto) if batch.prefill else f.mlp(w, x)
        else:
            self._head(w, batch, a)

    def _chunks(self, batch: GpuBatch) -> list[tuple[int, int]]:
        """The row chunks of `batch`'s prefill, by the tokens each row computes (its own past a shared prefix
        computed once: a 150-token prefix + 50 own tokens makes 4x fewer chunks of the same tokens; as the
        memory model counts)."""
        return row_chunks(batch.size, batch.prompt_len - batch.prefix_len, self.prefill_chunk_tokens)

    def _head(self, w, batch: GpuBatch, a: Action) -> None:
        blk = self.block
        x = blk.hidden[a.k]
        x = x[1] if isinstance(x, tuple) else x
        s = batch.prompt_len if batch.prefill else x.shape[1]
        logits = self.family.head(w, x[:, -1])                                             # [b, v]
        live = batch.live_index()
        rows = [batch.rows[r] for r in live]
        if len(live) < batch.size:
            logits = logits[torch.tensor(live, device=logits.device)]                     # [live, v]
        tokens, finished = blk.select(rows, logits)
        step = StepResult(s, live, [int(t) for t in tokens], [bool(f) for f in finished])
        blk.results[a.k] = step
        self._apply_step(a.k, step)
        blk.hidden[a.k] = None
        if all(b.done for b in blk.batches[a.k + 1:]):  # no later GPU batch chooses in this step
            end_step(blk.select)
        if a.k == len(blk.batches) - 1:
            self._step_done(a.i)

    def _apply_step(self, k: int, step: StepResult) -> None:
        """Record GPU batch k's step (positions written, tokens picked, rows ended) in its bookkeeping and
        compact its rows and caches when enough rows ended. The head runs it; a pipeline stage without
        the head replays the last stage's result with it, so every stage's batch is in the same state."""
        blk = self.block
        batch = blk.batches[k]
        batch.advance(step.advanced)
        picked: dict[int, int] = {}
        for r, tok, fin in zip(step.live, step.tokens, step.finished):
            batch.generated[r] += 1
            if fin or batch.generated[r] >= batch.max_new[r]:
                batch.finish(r)
            else:
                picked[r] = tok
        batch.set_next(picked)
        for i, j, kk in blk.compact(k):                  # prefetched before the compaction: load them again
            self._issue_cache(i, j, kk)

    def _step_done(self, i: int) -> None:
        if self.transfers.clock is not None:
            self.transfers.clock.close_step()
        now, blk = time.perf_counter(), self.block
        self.stats["prefill_s" if i == 0 else "decode_s"] += now - blk.t0
        self.step_s.append(now - blk.t0)
        self.stats["steps"] = i + 1
        blk.t0 = now

    # ---- teardown -------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, dict[str, int | None]]:
        """Bytes held now / peak / budget per tier, as counted by the executor."""
        return {t.value: {"used": self.budget.used[t], "peak": self.budget.peak[t], "budget": self.budget.limits.get(t)}
                for t in Tier}

    def close(self) -> None:
        """Free every buffer and file of this executor (idempotent): afterwards it holds no tensor, so the
        device memory is back in torch's allocator at once, whoever still references the executor."""
        self.host_attention.close()
        self.transfers.close()
        self._drop_block_state()
        self.ahead = None
        self.weights = self.on_action = self.profiler = None
        self.arena.close()
