"""The buffer plan: every buffer the executor allocates, on every tier, as data (pure; no tensors).

`buffer_plan` is the one function of (model layout, policy, workload) that lists them. The executor's arena
hands out only the plan's buffers, by name and at the plan's sizes (`engine.runtime.arena.Arena`: a request
outside the plan is an error), and the memory model's peak per tier is the plan's sum plus the compute's
working memory (`memory.executor_memory`). The workload is a `BlockShape`: the GPU batches of a block (rows,
padded prompt, cache positions, shared prefix) and its steps; the memory model's is the uniform block of a
`Workload`, the executor's the block it runs. Names, as the runtime asks for them ({j} an attention layer's
position among the executor's specs, {k} a GPU batch, {n} a cache segment along kv heads, `split_ranges`; a
4-bit buffer is one entry, its codes, mins and scales the arena's parts of it):

  weights (`weight_homes`, `weight_copies`):
    home.{layer}.{tensor}            a layer's tensor on its tier (`ModelLayout.placements`; disk: a weight file)
    packed.{layer}.{tensor}.codes|scales   a CPU run's int4 kernel operands of a 4-bit matmul weight held in
                                     memory (`engine.quant.config.int4_kernel_parts`), beside its home
    packed.{layer}.{tensor}.dense    with `Policy.cpu_dense_copy`, its dense copy (held in oneDNN's layout)
    wbuf{slot}.{kind}.{tensor}       device copy of a tensor some layer of the kind loads, per weight slot
                                     (`weight_slots.WeightSlots`; a kind loaded ahead keeps one, slot 0, for
                                     its 4-bit tensors)
    wrelay{slot}.{kind}.{tensor}     pinned relay of a disk tensor's load (CUDA)
    wdq.{kind}.{tensor}              dense device copy of a 4-bit tensor, dequantized for the compute (none
                                     where every layer's tensor has a dense copy beside it)
  a block (`block_buffers`):
    kv.{j}.{k}.s{n}.k|v              gpu cache homes [rows, heads, S - L, hd] (L: a prefix held once)
    {host}.{j}.{k}.s{n}.k|v          cpu/disk cache homes (`host`: "kv", or "kvx" in every other block whose
                                     prefill ran ahead); a 4-bit one loaded for decode is positions-major
                                     (memory [rows, S - L, heads, hd], `engine.runtime.kv_cache`)
    kv.{j}.{k}.prefix.k|v            a shared prefix's keys/values held once [1, nkv, L, hd]
                                     (`prefix.prefix_held_once`)
    kv.{j}.{k}.prefix_host.s{n}.k|v  host copy of the prefix's heads of a segment attended on the host
    kvbuf{slot}.s{n}.k|v             device copy of a loaded segment for a decode compute (slot: the parity of
                                     (i * J + j) * K + k)
    kvrelay{slot}.s{n}.k|v           pinned relay of a disk segment's load (CUDA)
    kvstage{slot}.s{n}.r{c}.k|v      pinned staging of a prefill store, row chunk c (CUDA; two slots)
    kvstaged{m}.s{n}.r0.k|v          pinned staging of a decode store (CUDA; `decode_stage_slots`)
    hattn.{k}.s{n}.q|k|v|out         pinned staging of host attention (CUDA, `pipelines_host_attention`)
    act.{k}.{n}                      the off-gpu parts of a parked prefill hidden state [rows, P, features]
  the next block's prefill run ahead (`ahead_buffers`, `runs_ahead`):
    kvpark.{j}.{k}.s{n}.k|v          its gpu segments, parked on the host until the switch
    kvpark.{j}.{k}.prefix.k|v        its batches' shared prefix keys/values [1, nkv, L, hd]
    {host}.{j}.{k}.s{n}.k|v          its cpu/disk homes (the other host name)
    kvstageahead{m}.s{n}.r0.k|v      pinned staging of its stores, one chunk's rows (CUDA; `ahead_stage_slots`)
    kv.{j}.{k}.s{n}.k|v, kv.{j}.{k}.prefix.k|v    the device homes its parked buffers move to at the switch

A buffer that several (layer, GPU batch) pairs share (kvbuf, staging) is planned at its largest use. The plan's
data types (`BufferSpec`, `BufferPlan`, `BlockShape`) are `engine.policy.buffer_spec`'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.policy.buffer_spec import BatchShape, BlockShape, BufferPlan, BufferSpec, merged
from engine.policy.layout import KindLayout, ModelConfig, ModelLayout
from engine.policy.placement import split_ranges
from engine.policy.policy import Policy
from engine.policy.prefix import prefix_held_once
from engine.policy.weight_slots import step_parities
from engine.policy.working import PREFILL_CHUNK_TOKENS, chunk_rows, row_chunks, rows_per_pass
from engine.quant.config import QuantConfig, int4_kernel_parts

DECODE_STAGE_SLOTS = 16


def runs_ahead(policy: Policy, gen_len: int, num_prompts: int | None) -> bool:
    """Whether the executor runs blocks' prefills ahead (`engine.runtime.ahead`) for this run: the policy says
    so, a block decodes at least one step and there is more than one block (`num_prompts` None: unbounded). A
    shared prefix is computed once per GPU batch there, as in a block's own prefill."""
    return policy.prefill_ahead and gen_len > 1 and (num_prompts is None or num_prompts > policy.block_size)


def pipelines_host_attention(config: ModelConfig, policy: Policy) -> bool:
    """Whether the executor runs host attention on its thread (MoE-Lightning's CGOPipe, `moe_schedule`)."""
    return policy.pipeline and policy.cpu_attention and config.is_moe


def decode_stage_slots(stores_per_step: int) -> int:
    """How many staging buffers a decode step's cache stores take in turn (`kvstaged{slot}`): a store waits for
    the store that last used its buffer (its host-side write), so with two the compute thread runs at most a
    layer ahead of the device (Mixtral-8x7B at 1024x2 on an H200 then waits 0.19 s of a 0.68 s step there);
    with up to DECODE_STAGE_SLOTS it runs that many stores ahead. A decode store is one position per row, small."""
    return min(DECODE_STAGE_SLOTS, stores_per_step)


def ahead_stage_slots(attention_layers: int) -> int:
    """How many staging buffers an ahead prefill's cache stores take in turn (`kvstageahead{slot}`, one chunk's
    rows each), as a decode step's do (`decode_stage_slots`): with two, the compute thread waits for the store
    two back, whose copy waits for the chunk's compute (Mixtral-8x7B at 512/32/24 GiB on an H200, 256x1 + ahead:
    0.154 s of a 0.408 s step with two buffers, 0.0003 s with the ring; the step stays 0.41 s, bound by the
    device's decode and carried prefill compute)."""
    return min(DECODE_STAGE_SLOTS, attention_layers)


def cache_slots(layout: ModelLayout, num_batches: int, steps: Sequence[int]) -> tuple[int, ...]:
    """The double-buffer slots ((i * J + j) * K + k) % 2 the cache loads of `steps` use (`Executor._slot`; J
    layer specs, j the attention layers, K GPU batches): both once K > 1, else those of i * J + j."""
    if not steps:
        return ()
    if num_batches > 1:
        return (0, 1)
    parities = {j % 2 for j in layout.attention_js}
    return tuple(sorted({(i * layout.num_specs + j) % 2 for i in steps for j in parities}))


def ahead_passes(batch_rows: Sequence[int], per_pass: int) -> list[list[tuple[int, int, int]]]:
    """An ahead prefill's passes over a block whose GPU batches have `batch_rows` rows: `per_pass` rows each, in
    row order; per pass, (k, first row, rows) of every batch it holds rows of."""
    passes, k, r = [], 0, 0
    while k < len(batch_rows):
        left, part = per_pass, []
        while left and k < len(batch_rows):
            n = min(left, batch_rows[k] - r)
            part.append((k, r, n))
            left, r = left - n, r + n
            if r == batch_rows[k]:
                k, r = k + 1, 0
        passes.append(part)
    return passes


def ahead_pass_rows(batch_rows: Sequence[int], per_pass: int) -> list[int]:
    """The most rows of each GPU batch one pass of `ahead_passes` holds (in closed form)."""
    out, start = [], 0
    for rows in batch_rows:
        end = start + rows
        first, last = start // per_pass, (end - 1) // per_pass
        most = min(end, (first + 1) * per_pass) - start
        if last > first:
            most = max(most, end - last * per_pass, per_pass if last - first >= 2 else 0)
        out.append(most)
        start = end
    return out


def _groups(batches: Sequence[BatchShape]) -> list[tuple[BatchShape, tuple[int, ...]]]:
    """The distinct batch shapes and the GPU batches of each, in order."""
    ks: dict[BatchShape, list[int]] = {}
    for k, batch in enumerate(batches):
        ks.setdefault(batch, []).append(k)
    return [(batch, tuple(members)) for batch, members in ks.items()]


def _pair(name: str, tier: str, shape: tuple[int, ...], dtype: str, owner: str, quant: QuantConfig | None,
          index: tuple[tuple, ...] = ()) -> list[BufferSpec]:
    """The keys and values buffers `{name}.k`, `{name}.v`."""
    return [BufferSpec(f"{name}.{part}", tier, shape, dtype, owner, quant, index) for part in ("k", "v")]


def _major(shape: tuple[int, ...], major: bool) -> tuple[int, ...]:
    """A cache buffer's memory shape: [b, h, S, hd], or [b, S, h, hd] held positions-major."""
    b, h, s, hd = shape
    return (b, s, h, hd) if major else shape


# ---- weights ---------------------------------------------------------------------------------------------
def weight_homes(layout: ModelLayout, policy: Policy, device_type: str) -> list[BufferSpec]:
    """Every layer's tensors on the tiers the policy's weight fractions give (`ModelLayout.placements`)."""
    key = ("weight_homes", policy.w_gpu, policy.w_cpu, policy.w_gpu_extra, device_type, policy.cpu_dense_copy)
    return layout.derived(key, lambda: _weight_homes(layout, policy, device_type))


def _weight_homes(layout: ModelLayout, policy: Policy, device_type: str) -> list[BufferSpec]:
    out = []
    for kl in layout.kinds:
        for tiers, js in layout.placements(policy.w_gpu, policy.w_cpu, device_type, policy.w_gpu_extra)[id(kl)]:
            names = kl.layer_names if js == kl.js else tuple(layout.layers[j].name for j in js)
            out.extend(BufferSpec(f"home.{{}}.{name}", tier, shape, layout.dtype,
                                  "weight files" if tier == "disk" else "weights", quant, (names,))
                       for name, tier, shape, quant in zip(kl.names, tiers, kl.shapes, kl.quants))
            if device_type == "cpu":
                out.extend(_packed_for_cpu(layout, kl, tiers, names, policy.cpu_dense_copy))
    return out


def _packed_for_cpu(layout: ModelLayout, kl: KindLayout, tiers: Sequence[str], names: tuple[str, ...],
                    dense: bool) -> list[BufferSpec]:
    """On a CPU run, the int4 kernel's operands of the 4-bit matmul weights held in memory (not on disk),
    beside their homes (`engine.models.cpu_linear.Int4Linear`; a dense bfloat16 one is reordered in place of
    its home, the same bytes), and with `dense` (`Policy.cpu_dense_copy`) each one's dense copy
    `packed.{layer}.{tensor}.dense`, [n, k] in the model's dtype (held reordered into oneDNN's layout, the
    same bytes)."""
    return [BufferSpec(f"packed.{{}}.{name}.{part}", tier, shape, dtype, "packed weights", None, (names,))
            for name, tier, shape, quant, linear in zip(kl.names, tiers, kl.shapes, kl.quants, kl.linear)
            if linear and tier != "disk"
            for part, shape, dtype in _cpu_parts(shape, layout.dtype, quant, dense)]


def _cpu_parts(shape: tuple[int, ...], dtype: str, quant: QuantConfig | None,
               dense: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """A 4-bit matmul weight's CPU forms beside its home: the int4 kernel's operands (none when the kernel
    does not take it) and, with `dense`, its dense copy."""
    parts = int4_kernel_parts(shape, dtype, quant)
    return [*parts, ("dense", shape, dtype)] if parts and dense else parts


def _dense_beside(layout: ModelLayout, policy: Policy, device_type: str, kl: KindLayout, n: int) -> bool:
    """Whether every layer of kind `kl` holds its tensor n with a dense copy beside it (`_packed_for_cpu`),
    so a prefill never dequantizes it into the kind's `wdq` buffer."""
    if device_type != "cpu" or not policy.cpu_dense_copy or not kl.linear[n]:
        return False
    placed = layout.placements(policy.w_gpu, policy.w_cpu, device_type, policy.w_gpu_extra)[id(kl)]
    return (bool(int4_kernel_parts(kl.shapes[n], layout.dtype, kl.quants[n]))
            and all(tiers[n] != "disk" for tiers, _ in placed))


def weight_copies(layout: ModelLayout, policy: Policy, device_type: str,
                  steps: Sequence[int] = (0, 1)) -> list[BufferSpec]:
    """The device buffers weight loads fill and the dequantized copies of 4-bit tensors, over the steps
    `steps` (`weight_slots.step_parities`)."""
    key = ("weight_copies", policy.w_gpu, policy.w_cpu, policy.w_gpu_extra, device_type, tuple(steps),
           policy.cpu_dense_copy)
    return layout.derived(key, lambda: _weight_copies(layout, policy, device_type, steps))


def _weight_copies(layout: ModelLayout, policy: Policy, device_type: str, steps: Sequence[int]) -> list[BufferSpec]:
    cuda, out = device_type == "cuda", []
    placements = layout.placements(policy.w_gpu, policy.w_cpu, device_type, policy.w_gpu_extra)
    for kl in layout.kinds:
        for n, (name, shape, quant) in enumerate(zip(kl.names, kl.shapes, kl.quants)):
            group = placements[id(kl)]
            moving = [j for tiers, js in group if tiers[n] == "disk" or (tiers[n] == "cpu" and cuda) for j in js]
            relayed = [j for tiers, js in group if tiers[n] == "disk" and cuda for j in js]
            for prefix, tier, owner, js in (("wbuf", "gpu", "weight loads", moving),
                                            ("wrelay", "cpu", "weight relays", relayed)):
                if js:
                    slots = (0,) if kl.ahead and quant is not None else layout.slots.slot_set(js, steps)
                    out.append(BufferSpec(f"{prefix}{{}}.{kl.kind}.{name}", tier, shape, layout.dtype, owner, quant,
                                          (slots,)))
            if quant is not None and not _dense_beside(layout, policy, device_type, kl, n):
                out.append(BufferSpec(f"wdq.{kl.kind}.{name}", "gpu", shape, layout.dtype, "dequantized weights"))
    return list(merged(out))


# ---- a block's cache and hidden states ---------------------------------------------------------------
@dataclass(frozen=True)
class _Cache:
    """What the cache's buffers depend on besides the block: the geometry, the flags and the device."""

    heads: int
    head_dim: int
    query_group: int
    hidden: int
    dtype: str
    quant: QuantConfig | None
    device_type: str
    chunk_tokens: int
    pipelined: bool

    @property
    def cuda(self) -> bool:
        return self.device_type == "cuda"

    def held(self, batch: BatchShape) -> int:
        """The prefix positions held once, not in each row's home (`prefix.prefix_held_once`)."""
        return batch.prefix_len if prefix_held_once(self.device_type, self.quant is not None) else 0

    def aliased(self, tier: str) -> bool:
        """Whether the compute reads a home on `tier` in place (a dense cpu home on a CPU-only machine)."""
        return tier == "cpu" and self.device_type == "cpu" and self.quant is None


def _cache(config: ModelConfig, layout: ModelLayout, policy: Policy, device_type: str,
           cache_quant: QuantConfig | None, chunk_tokens: int) -> _Cache:
    return _Cache(config.num_key_value_heads, config.head_dim,
                  config.num_attention_heads // config.num_key_value_heads, config.hidden_size, layout.dtype,
                  cache_quant if policy.compress_cache else None, device_type, chunk_tokens,
                  pipelines_host_attention(config, policy))


def block_buffers(config: ModelConfig, layout: ModelLayout, policy: Policy, block: BlockShape, device_type: str,
                  *, cache_quant: QuantConfig | None = None, chunk_tokens: int = PREFILL_CHUNK_TOKENS,
                  host: str = "kv", tag: str = "") -> list[BufferSpec]:
    """The cache homes, their load and store buffers and the parked hidden states of one block (module
    docstring); `cache_quant` the cache's grouping when the policy compresses it, `host` the name of its
    cpu/disk homes, `tag` a suffix of its homes' names (a pipeline stage's micro-batch: `kv.m0.{j}.{k}...`)."""
    c = _cache(config, layout, policy, device_type, cache_quant, chunk_tokens)
    js, K = layout.attention_js, len(block.batches)
    prefill, decode = block.first == 0, block.steps > max(block.first, 1)
    kv_slots = cache_slots(layout, K, step_parities(max(block.first, 1), block.steps))
    stage_slots = tuple(range(min(2, len(js) * K))) if prefill else ()
    out: list[BufferSpec] = []
    for batch, ks in _groups(block.batches):
        held, own = c.held(batch), batch.length - c.held(batch)
        if held:
            out += _pair(f"kv{tag}.{{}}.{{}}.prefix", "gpu", (1, c.heads, held, c.head_dim), c.dtype, "shared prefix",
                         None, (js, ks))
        for n, (tier, h0, h1) in enumerate(split_ranges(c.heads, policy.cache_gpu, policy.cache_cpu)):
            h = h1 - h0
            home = (batch.rows, h, own, c.head_dim)
            major = c.quant is not None and tier != "gpu" and not policy.cpu_attention
            name = f"kv{tag}.{{}}.{{}}.s{n}" if tier == "gpu" else f"{host}{tag}.{{}}.{{}}.s{n}"
            out += _pair(name, tier, _major(home, major), c.dtype, "cache homes", c.quant, (js, ks))
            if tier == "gpu" or c.aliased(tier):
                continue
            if prefill and c.cuda:
                chunks: dict[int, list[int]] = {}                         # rows -> the row chunks of that many
                for r, (r0, r1) in enumerate(row_chunks(batch.rows, batch.prompt_len - batch.prefix_len,
                                                        chunk_tokens)):
                    chunks.setdefault(r1 - r0, []).append(r)
                for rows, rs in chunks.items():
                    shape = _major((rows, h, batch.prompt_len - held, c.head_dim), major)
                    out += _pair(f"kvstage{{}}.s{n}.r{{}}", "cpu", shape, c.dtype, "cache stores", c.quant,
                                 (stage_slots, tuple(rs)))
            if policy.cpu_attention:
                out += _host_attention(c, batch, js, ks, n, h, held, tag) if decode else []
                continue
            if decode:
                out += _cache_loads(c, batch, n, tier, _major(home, major), kv_slots)
                if c.cuda:
                    shape = _major((batch.rows, h, 1, c.head_dim), major)
                    out += _pair(f"kvstaged{{}}.s{n}.r0", "cpu", shape, c.dtype, "cache stores", c.quant,
                                 (tuple(range(decode_stage_slots(len(js) * K))),))
    return out + _hidden_homes(c, policy, block)


def _cache_loads(c: _Cache, batch: BatchShape, n: int, tier: str, shape: tuple[int, ...],
                 slots: Sequence[int]) -> list[BufferSpec]:
    """The device copies a decode loads segment n into (and, on CUDA, a disk segment's relays)."""
    out = _pair(f"kvbuf{{}}.s{n}", "gpu", shape, c.dtype, "cache loads", c.quant, (tuple(slots),))
    if c.cuda and tier == "disk":
        out += _pair(f"kvrelay{{}}.s{n}", "cpu", shape, c.dtype, "cache relays", c.quant, (tuple(slots),))
    return out


def _host_attention(c: _Cache, batch: BatchShape, js: tuple[int, ...], ks: tuple[int, ...], n: int, h: int,
                    held: int, tag: str) -> list[BufferSpec]:
    """Segment n attended on the host at decode: its copy of the shared prefix's heads, and with the MoE
    pipeline on CUDA the pinned staging of one GPU batch's q/k/v and output (`engine.runtime.host_attention`)."""
    out = []
    if held:
        out += _pair(f"kv{tag}.{{}}.{{}}.prefix_host.s{n}", "cpu", (1, h, held, c.head_dim), c.dtype,
                     "host prefix", None, (js, ks))
    if c.pipelined and c.cuda:
        q = (batch.rows, h * c.query_group, 1, c.head_dim)
        kv = (batch.rows, h, 1, c.head_dim)
        out += [BufferSpec(f"hattn.{{}}.s{n}.{part}", "cpu", shape, c.dtype, "host attention", None, (ks,))
                for part, shape in (("q", q), ("k", kv), ("v", kv), ("out", q))]
    return out


def _hidden_homes(c: _Cache, policy: Policy, block: BlockShape) -> list[BufferSpec]:
    """The off-gpu parts of the prefill's parked hidden states (`engine.runtime.act_homes`): a batch's hidden
    [rows, P, h] is parked between layers when another batch computes next (two or more GPU batches), never a
    (prefix, rows) pair nor a single position; on a CPU device the cpu tier is the compute's memory."""
    if block.first or len(block.batches) < 2 or policy.act_gpu >= 1.0:
        return []
    if c.device_type == "cpu" and policy.act_gpu + policy.act_cpu >= 1.0:
        return []
    out = []
    for batch, ks in _groups(block.batches):
        if batch.prefix_len or batch.prompt_len <= 1:
            continue
        for n, (tier, a, b) in enumerate(split_ranges(c.hidden, policy.act_gpu, policy.act_cpu)):
            if tier == "gpu" or (tier == "cpu" and c.device_type == "cpu"):
                continue
            out.append(BufferSpec(f"act.{{}}.{n}", tier, (batch.rows, batch.prompt_len, b - a), c.dtype,
                                  "hidden homes", None, (ks,)))
    return out


# ---- the next block's prefill, run ahead -------------------------------------------------------------
def ahead_buffers(config: ModelConfig, layout: ModelLayout, policy: Policy, block: BlockShape, device_type: str,
                  *, decode_steps: int, cache_quant: QuantConfig | None = None,
                  chunk_tokens: int = PREFILL_CHUNK_TOKENS, host: str = "kvx") -> list[BufferSpec]:
    """The buffers of `block`'s prefill run ahead on `decode_steps` decode steps of the block before it
    (`engine.runtime.ahead`; module docstring): its cache homes, the gpu segments parked on the host, its shared
    prefixes' keys/values, its stores' staging, and the device homes its parked buffers move to."""
    c = _cache(config, layout, policy, device_type, cache_quant, chunk_tokens)
    js = layout.attention_js
    per_pass = rows_per_pass(sum(b.rows for b in block.batches), decode_steps)
    most = ahead_pass_rows([b.rows for b in block.batches], per_pass)
    out: list[BufferSpec] = []
    for batch, ks in _groups(block.batches):
        held, own = c.held(batch), batch.length - c.held(batch)
        if batch.prefix_len:
            out += _pair("kvpark.{}.{}.prefix", "gpu", (1, c.heads, batch.prefix_len, c.head_dim), c.dtype,
                         "shared prefix", None, (js, ks))
        if held:
            out += _pair("kv.{}.{}.prefix", "gpu", (1, c.heads, held, c.head_dim), c.dtype, "shared prefix", None,
                         (js, ks))
        rows = max(chunk_rows(most[k], batch.prompt_len - batch.prefix_len, chunk_tokens) for k in ks)
        for n, (tier, h0, h1) in enumerate(split_ranges(c.heads, policy.cache_gpu, policy.cache_cpu)):
            home = (batch.rows, h1 - h0, own, c.head_dim)
            major = c.quant is not None and tier != "gpu" and not policy.cpu_attention
            if tier == "gpu":
                out += _pair(f"kvpark.{{}}.{{}}.s{n}", "cpu", home, c.dtype, "cache homes", c.quant, (js, ks))
                out += _pair(f"kv.{{}}.{{}}.s{n}", "gpu", home, c.dtype, "cache homes", c.quant, (js, ks))
            else:
                out += _pair(f"{host}.{{}}.{{}}.s{n}", tier, _major(home, major), c.dtype, "cache homes", c.quant,
                             (js, ks))
            if c.cuda:
                shape = _major((rows, h1 - h0, batch.prompt_len - held, c.head_dim), major)
                out += _pair(f"kvstageahead{{}}.s{n}.r0", "cpu", shape, c.dtype, "cache stores", c.quant,
                             (tuple(range(ahead_stage_slots(len(js)))),))
    return out


def buffer_plan(config: ModelConfig, layout: ModelLayout, policy: Policy, block: BlockShape, device_type: str, *,
                ahead: BlockShape | None = None, cache_quant: QuantConfig | None = None,
                chunk_tokens: int = PREFILL_CHUNK_TOKENS, host: str = "kv", next_host: str = "kvx",
                tag: str = "") -> BufferPlan:
    """Every buffer of a run of `block` under `policy` on a `device_type` device: the weights' homes and load
    buffers, the block's cache and hidden-state buffers (cpu/disk homes named `host`, names suffixed `tag`,
    `block_buffers`), and with `ahead` the buffers of that next block's prefill run on this one's decode steps
    (its cpu/disk homes named `next_host`). `layout` is the model's (`ModelLayout.view` of the policy's weight
    compression)."""
    steps = step_parities(block.first, block.steps)
    entries = [*weight_homes(layout, policy, device_type), *weight_copies(layout, policy, device_type, steps),
               *block_buffers(config, layout, policy, block, device_type, cache_quant=cache_quant,
                              chunk_tokens=chunk_tokens, host=host, tag=tag)]
    if ahead is not None:
        entries += ahead_buffers(config, layout, policy, ahead, device_type, decode_steps=block.steps - 1,
                                 cache_quant=cache_quant, chunk_tokens=chunk_tokens, host=next_host)
    return BufferPlan(merged(entries))
