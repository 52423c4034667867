"""Memory per tier of a policy, counted the way the executor counts it (pure arithmetic, no tensors).

`executor_memory` mirrors, buffer by buffer, what `engine.runtime.executor.Executor` reserves against its
hard budgets for one block of `num_gpu_batches x gpu_batch_size` rows (prompt P, gen n, S = P + n - 1
cache positions):
  - weight homes: each layer spec's tensors on the tier `weight_tiers` gives them (and `with_extra` for
    `Policy.w_gpu_extra`: one more tensor on the gpu in each of the first layers that stream one), or on the
    gpu for the kinds held whole (`weight_slots.held_whole`: on CUDA, the embedding and the head) (stored size: 4-bit
    `qtensor_nbytes` in the grouping `stored_quant` gives: an int4 checkpoint's packed weights in its own
    groups, other quantizable tensors in the model's `weight_quant` groups when compressing weights), disk
    homes are files (disk tier);
  - `wbuf{slot}.{kind}.{name}`: a device buffer per tensor some layer of the kind streams, per kind and weight slot
    (`engine.policy.weight_slots`: one per kind whose layers are never adjacent); `wdq.{kind}.{name}`: one
    dense device buffer per compressed tensor and kind; `wrelay{slot}...` pinned relay buffers for disk
    tensors (CUDA only);
  - the working memory of one GPU batch (`working_bytes`);
  - KV homes `kv.{j}.{k}.s{n}`: [g, heads of segment n, S - p, hd] keys and values per attention layer and GPU
    batch (p: the batch's shared prefix, `prefix.batch_prefix_len`, whose keys and values
    `kv.{j}.{k}.prefix` [1, nkv, p, hd] are held once, dense, on the device; with CPU attention a host copy
    `prefix_host.s{n}` of each off-gpu segment's heads), segments cut along kv heads by `split_ranges`;
    `kvbuf{slot}` device copies of non-gpu segments
    (decode without CPU attention), `kvrelay{slot}` for disk segments, `kvstage{slot}.s{n}.r{c}` pinned staging
    of the prefill's positions, one per prefill row chunk c (CUDA; slot = the store's count in the block % 2),
    and `kvstaged{slot}.s{n}.r0` of a decode step's new position (CUDA; `decode_stage_slots` of them in turn);
  - hidden-state homes `act.{k}.{n}` of the non-gpu parts of the prefill's hidden states (a decode step's
    [g, 1, h] never leaves the gpu; with a shared prefix computed once nothing is parked: `engine.policy.prefix`);
  - MoE pipeline with CPU attention (CUDA): `hattn.{k}.s{n}.q/k/v/out`, pinned staging of one GPU batch's
    new q/k/v and its attention output per host cache segment n (`engine.runtime.host_attention`).
`memory_terms` gives the same sums as affine expressions in the placement fractions (for the LP), with
the tiers' shares taken as exact fractions of bytes (on CUDA the held kinds' bytes are a floor of the gpu
share, `ModelLayout.held_fraction`); `realized_placement` gives the fractions of bytes a policy's rounded
placement really puts on each tier.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from engine.models.config import ModelConfig
from engine.models.registry import build_family
from engine.models.weights import stored_quant, weight_quant
from engine.policy.affine import const, share
from engine.policy.policy import Policy
from engine.policy.prefix import batch_prefix_len, prefix_held_once
from engine.policy.weight_slots import WeightSlots, held_whole, kind_fractions, streamed_ahead
from engine.policy.working import chunk_rows, row_chunks, rows_per_pass, staged_kv_heads, working_bytes
from engine.quant.config import CACHE_QUANT
from engine.quant.qtensor import qtensor_nbytes
from engine.storage.placement import first_off_gpu, split_ranges, weight_tiers, with_extra
from engine.storage.tiers import Tier

TIERS = ("gpu", "cpu", "disk")
_DTYPE_OF_SIZE = {2: torch.float16, 4: torch.float32, 8: torch.float64}
_STEP = 1e-6          # a placement fraction just past a tensor's midpoint


def dtype_of_size(bytes_per_element: int) -> torch.dtype:
    if bytes_per_element not in _DTYPE_OF_SIZE:
        raise ValueError(f"bytes_per_element must be one of {sorted(_DTYPE_OF_SIZE)}, got {bytes_per_element}")
    return _DTYPE_OF_SIZE[bytes_per_element]


@dataclass(frozen=True)
class KindLayout:
    """The tensors of one layer kind (embed, attention, mlp, head) and shape: `count` specs of that kind with
    these tensors (names, stored bytes, dense bytes, compressed?) in order, and the weight slots their loads
    use (`slot_set`). A kind whose layers differ (DeepSeek's dense first MLPs, Qwen-MoE's
    `mlp_only_layers`) has one KindLayout per distinct set of tensors."""

    kind: str
    count: int
    stored: tuple[int, ...]
    dense: tuple[int, ...]
    packed: tuple[bool, ...]
    names: tuple[str, ...] = ()
    slot_set: tuple[int, ...] = ()
    ahead: bool = False                  # loaded a layer ahead: its packed tensors have one buffer (slot 0)
    js: tuple[int, ...] = ()             # the layer specs' positions in the executor's order


@dataclass(frozen=True)
class ModelLayout:
    """What the executor's weight homes hold for one model, dtype and weight compression."""

    kinds: tuple[KindLayout, ...]
    num_specs: int
    attention_js: tuple[int, ...]
    total_bytes: int
    midpoints: tuple[float, ...]          # sorted fractions at which some tensor changes tier
    once: frozenset[str] = frozenset()    # kinds of one layer: held whole on CUDA (`weight_slots.held_whole`)

    def held(self, device_type: str) -> frozenset[str]:
        """The kinds the executor holds whole on a `device_type` device, whatever the weight fractions."""
        return self.once if device_type == "cuda" else frozenset()

    def tiers(self, kl: KindLayout, w_gpu: float, w_cpu: float, device_type: str) -> list[Tier]:
        """The tier of each of group kl's tensors under these policy fractions, as the executor places them."""
        return weight_tiers(list(kl.stored), *kind_fractions(kl.kind, self.held(device_type), w_gpu, w_cpu))

    def placed(self, w_gpu: float, w_cpu: float, device_type: str,
               extra: int = 0) -> dict[int, list[tuple[tuple[Tier, ...], int]]]:
        """Per group (keyed by `id` of its KindLayout), (the tiers of its tensors, how many of its layers have
        them) as the executor places them: the fractions' tiers, then `extra` more tensors on the gpu
        (`with_extra`, in layer order)."""
        base = {id(kl): tuple(self.tiers(kl, w_gpu, w_cpu, device_type)) for kl in self.kinds}
        if not extra:                                  # every layer of a group alike
            return {id(kl): [(base[id(kl)], kl.count)] for kl in self.kinds}
        at = {j: kl for kl in self.kinds for j in kl.js}
        order = sorted(at)
        counts: dict[int, Counter] = {id(kl): Counter() for kl in self.kinds}
        for j, layer in zip(order, with_extra([base[id(at[j])] for j in order], extra)):
            counts[id(at[j])][tuple(layer)] += 1
        return {key: list(c.items()) for key, c in counts.items()}

    def bytes_on(self, placed: dict[int, list[tuple[tuple[Tier, ...], int]]]) -> dict[Tier, int]:
        """Weight bytes per tier of a placement `placed` returned."""
        on = {t: 0 for t in Tier}
        for kl in self.kinds:
            for tiers, count in placed[id(kl)]:
                for size, tier in zip(kl.stored, tiers):
                    on[tier] += count * size
        return on

    def extra_sizes(self, w_gpu: float, w_cpu: float, device_type: str) -> list[int]:
        """Stored bytes of the tensor each further `Policy.w_gpu_extra` puts on the gpu, in turn (`with_extra`'s
        order: the first tensor off the gpu of each layer that has one, in layer order)."""
        sizes = {}
        for kl in self.kinds:
            off = first_off_gpu(self.tiers(kl, w_gpu, w_cpu, device_type))
            if off is not None:
                sizes.update({j: kl.stored[off] for j in kl.js})
        return [sizes[j] for j in sorted(sizes)]

    def held_fraction(self, device_type: str) -> float:
        """The fraction of all weight bytes the held kinds take: on the gpu under every policy."""
        held = self.held(device_type)
        return sum(kl.count * sum(kl.stored) for kl in self.kinds if kl.kind in held) / (self.total_bytes or 1)


def model_layout(config: ModelConfig, bytes_per_element: int, compress_weights: bool) -> ModelLayout:
    """The executor's weight tensors per layer kind and shape (the decoder layers of one group have the same
    tensors). An int4 checkpoint's packed weights (`config.quantization_config`) count in its own groups
    whatever `compress_weights` says."""
    dtype = dtype_of_size(bytes_per_element)
    specs = build_family(config).layer_specs()
    J = len(specs)
    wquant = weight_quant(config) if compress_weights else None
    ahead = streamed_ahead(config, specs, wquant)
    slots = WeightSlots([spec.kind for spec in specs], ahead)
    first: dict[tuple, object] = {}
    js: dict[tuple, list[int]] = {}
    for j, spec in enumerate(specs):
        key = (spec.kind, tuple((n, w.shape, w.quantizable) for n, w in spec.weights.items()))
        first.setdefault(key, spec)
        js.setdefault(key, []).append(j)
    kinds, mids = [], set()
    for key, spec in first.items():
        quants = [stored_quant(config, w, wquant) for w in spec.weights.values()]
        packed = tuple(q is not None for q in quants)
        dense = tuple(w.numel * bytes_per_element for w in spec.weights.values())
        stored = tuple(qtensor_nbytes(w.shape, dtype, q) if q else d
                       for w, q, d in zip(spec.weights.values(), quants, dense))
        slot_set = slots.slot_set(js[key])
        kinds.append(KindLayout(spec.kind, len(js[key]), stored, dense, packed, tuple(spec.weights),
                                slot_set, spec.kind in ahead, tuple(js[key])))
        total, start = sum(stored) or 1, 0
        for size in stored:
            mids.add((start + size / 2) / total)
            start += size
    total_bytes = sum(k.count * sum(k.stored) for k in kinds)
    attention_js = tuple(sorted(j for key, group in js.items() if key[0] == "attention" for j in group))
    once = held_whole([spec.kind for spec in specs], "cuda")
    return ModelLayout(tuple(kinds), J, attention_js, total_bytes, tuple(sorted(mids)), once)


def _buffer_bytes(layout: ModelLayout, size_of, slotted: bool = True) -> int:
    """Bytes of device buffers keyed by (slot, kind, tensor name), as the executor's arena keys them
    (`wbuf{slot}.{kind}.{name}`: groups of one kind share a name's buffer, grown to the largest; without
    `slotted`, one per kind and name, as `wdq.{kind}.{name}`): `size_of(kl, n)` is tensor n of group kl's
    bytes in that buffer, 0 when it needs none."""
    held: dict[tuple[int, str, str], int] = {}
    for kl in layout.kinds:
        for n, name in enumerate(kl.names):
            size = size_of(kl, n)
            if size:
                for slot in (kl.slot_set if slotted and not (kl.ahead and kl.packed[n]) else (0,)):
                    held[(slot, kl.kind, name)] = max(held.get((slot, kl.kind, name), 0), size)
    return sum(held.values())


def _kv_bytes(rows: int, heads: int, length: int, head_dim: int, dtype: torch.dtype, compressed: bool) -> int:
    """Bytes of one keys (or values) tensor [rows, heads, length, head_dim], dense or 4-bit."""
    if compressed:
        return qtensor_nbytes((rows, heads, length, head_dim), dtype, CACHE_QUANT)
    return rows * heads * length * head_dim * torch.empty((), dtype=dtype).element_size()


def _kv_slots(layout: ModelLayout, steps: tuple[int, ...], num_batches: int) -> int:
    """How many distinct KV buffer slots (parities of (i * J + j) * K + k) the given steps use."""
    J = layout.num_specs
    return len({((i * J + j) * num_batches + k) % 2 for i in steps for j in layout.attention_js
                for k in range(num_batches)})


def _stage_slots(layout: ModelLayout, policy: Policy) -> int:
    """How many staging buffers the prefill's cache stores use: they alternate per store, so two once a step
    stores twice."""
    return min(2, len(layout.attention_js) * policy.num_gpu_batches)


DECODE_STAGE_SLOTS = 16


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


def _ahead_stage_bytes(per: int, heads: int, prompt_len: int, prefix: int, held: int, head_dim: int,
                       dtype: torch.dtype, compressed: bool, attention_layers: int) -> int:
    """Pinned bytes of an ahead prefill's store staging over `heads` kv heads (`kvstageahead{slot}`, keys +
    values of one row chunk of a `per`-row pass, `ahead_stage_slots` sets)."""
    chunk = chunk_rows(per, prompt_len - prefix)
    return ahead_stage_slots(attention_layers) * 2 * _kv_bytes(chunk, heads, prompt_len - held, head_dim, dtype,
                                                               compressed)


def _decode_stage_bytes(layout: ModelLayout, policy: Policy, heads: int, head_dim: int, dtype: torch.dtype,
                        gen_len: int) -> int:
    """Bytes of the decode stores' staging (keys + values [rows, heads, 1, hd], `decode_stage_slots` sets) for
    `heads` kv heads off the gpu; none without a decode step or with CPU attention (the host writes its homes)."""
    if gen_len <= 1 or policy.cpu_attention:
        return 0
    slots = decode_stage_slots(len(layout.attention_js) * policy.num_gpu_batches)
    return slots * 2 * _kv_bytes(policy.gpu_batch_size, heads, 1, head_dim, dtype, policy.compress_cache)


def _stage_bytes(rows: int, heads: int, prompt_len: int, head_dim: int, dtype: torch.dtype, compressed: bool,
                 prefix_len: int = 0, held_once: bool = True) -> int:
    """Bytes of one set of the prefill's staging buffers (keys + values) `kvstage{slot}.s{n}.r{c}`: one per row
    chunk (`row_chunks` by the rows' own tokens past a prefix of `prefix_len` computed once; each chunk's keys
    hold the rows' own prompt positions when the prefix is `held_once` on the device, else the whole prompt)."""
    stored = prompt_len - (prefix_len if held_once else 0)
    return sum(2 * _kv_bytes(r1 - r0, heads, stored, head_dim, dtype, compressed)
               for r0, r1 in row_chunks(rows, prompt_len - prefix_len))


def pipelines_host_attention(config: ModelConfig, policy: Policy) -> bool:
    """Whether the executor runs host attention on its thread (MoE-Lightning's CGOPipe, `moe_schedule`)."""
    return policy.pipeline and policy.cpu_attention and config.is_moe


def _host_stage_bytes(config: ModelConfig, rows: int, heads: int, bytes_per_element: int) -> int:
    """Bytes of one GPU batch's `hattn` staging for `heads` kv heads: q and out [rows, heads * g, 1, hd],
    k and v [rows, heads, 1, hd]."""
    group = config.num_attention_heads // config.num_key_value_heads
    return rows * config.head_dim * bytes_per_element * (2 * group * heads + 2 * heads)


def _prefix_kv_bytes(heads: int, prefix_len: int, head_dim: int, bytes_per_element: int) -> int:
    """Bytes of one (layer, GPU batch)'s shared-prefix keys + values [1, heads, L, hd], dense (`KVHome.prefix`)."""
    return 2 * heads * prefix_len * head_dim * bytes_per_element


def _decode_steps(gen_len: int) -> tuple[int, ...]:
    return tuple(i for i in (1, 2) if i < gen_len)


def _act_home_len(prompt_len: int, gen_len: int, prefix: int) -> int:
    """Positions of a GPU batch's parked hidden state: the prefill's [g, P, h]. Nothing is parked with a prefix
    computed once (`prefix.batch_prefix_len`: its prefill pair stays on the gpu), nor a single position (a
    decode step's [g, 1, h] never leaves the gpu: `engine.runtime.act_homes`)."""
    return prompt_len if not prefix and prompt_len > 1 else 0


def runs_ahead(policy: Policy, gen_len: int, num_prompts: int | None) -> bool:
    """Whether the executor runs blocks' prefills ahead (`engine.runtime.ahead`) for this run: the policy says
    so, a block decodes at least one step and there is more than one block (`num_prompts` None: unbounded). A
    shared prefix is computed once per GPU batch there, as in a block's own prefill."""
    return policy.prefill_ahead and gen_len > 1 and (num_prompts is None or num_prompts > policy.block_size)


def _ahead_memory(config: ModelConfig, policy: Policy, prompt_len: int, gen_len: int, dtype: torch.dtype,
                  device_type: str, prefix: int) -> dict[str, int]:
    """What an ahead prefill adds while the block before it runs (the executor's `_start_ahead`): one pass's
    device working memory (`rows_per_pass` rows, every cache segment's keys/values staged for its store); the
    next block's cache homes on their tiers, its gpu segments parked on the host (`kvpark`); with a shared
    prefix of `prefix` tokens per GPU batch (`prefix.batch_prefix_len`) its keys/values on the device
    (`kvpark.{j}.{k}.prefix`, held once or kept for the passes); on CUDA the pinned staging of its stores
    (`kvstageahead{slot}.s{n}.r0`, one chunk's rows, `ahead_stage_slots` of them)."""
    g, K, L = policy.gpu_batch_size, policy.num_gpu_batches, config.num_hidden_layers
    P, S, hd, nkv = prompt_len, prompt_len + gen_len - 1, config.head_dim, config.num_key_value_heads
    cc, cuda = policy.compress_cache, device_type == "cuda"
    held = prefix if prefix_held_once(device_type, cc) else 0                # prefix positions held once
    per = min(rows_per_pass(policy.block_size, gen_len - 1), g)
    staged = staged_kv_heads(nkv, 0.0, 1.0, device_type, cc)
    mem = {t: 0 for t in TIERS}
    mem["gpu"] += working_bytes(config, per, P, S, dtype, cc, staged, prefix_len=prefix)
    mem["gpu"] += L * K * _prefix_kv_bytes(nkv, prefix, hd, torch.empty((), dtype=dtype).element_size())
    for tier, h0, h1 in split_ranges(nkv, policy.cache_gpu, policy.cache_cpu):
        home = 2 * _kv_bytes(g, h1 - h0, S - held, hd, dtype, cc)
        mem["cpu" if tier is Tier.GPU else tier.value] += L * K * home
        if cuda:
            mem["cpu"] += _ahead_stage_bytes(per, h1 - h0, P, prefix, held, hd, dtype, cc, L)
    return mem


def executor_memory(config: ModelConfig, layout: ModelLayout, policy: Policy, prompt_len: int, gen_len: int,
                    bytes_per_element: int, device_type: str, *, shared_prefix_len: int = 0,
                    num_prompts: int | None = 1) -> dict[str, int]:
    """Peak bytes per tier the executor reserves for one full block (its budgets' accounting), exactly.
    `shared_prefix_len`: the run's shared prompt prefix (`Workload.shared_prefix_len`); `num_prompts` the
    run's rows (None: unbounded): with more than one block and `policy.prefill_ahead`, the ahead prefill's
    memory while the block before it runs (`runs_ahead`, `_ahead_memory`)."""
    dtype, e = dtype_of_size(bytes_per_element), bytes_per_element
    cuda = device_type == "cuda"
    mem = {t: 0 for t in TIERS}
    placed = layout.placed(policy.w_gpu, policy.w_cpu, device_type, policy.w_gpu_extra)
    for tier, size in layout.bytes_on(placed).items():
        mem[tier.value] += size

    def moved(kl: KindLayout, n: int) -> int:              # some layer of the group loads tensor n
        off = any(t[n] is Tier.DISK or (t[n] is Tier.CPU and cuda) for t, _ in placed[id(kl)])
        return kl.stored[n] if off else 0

    mem["gpu"] += _buffer_bytes(layout, moved)                                                      # wbuf
    if cuda:
        mem["cpu"] += _buffer_bytes(layout, lambda kl, n: kl.stored[n] * any(t[n] is Tier.DISK
                                                                             for t, _ in placed[id(kl)]))  # wrelay
    mem["gpu"] += _buffer_bytes(layout, lambda kl, n: kl.dense[n] * kl.packed[n], slotted=False)    # wdq
    g, K, L = policy.gpu_batch_size, policy.num_gpu_batches, len(layout.attention_js)
    P, S, hd = prompt_len, prompt_len + gen_len - 1, config.head_dim
    cc = policy.compress_cache
    staged = staged_kv_heads(config.num_key_value_heads, policy.cache_gpu, policy.cache_cpu, device_type, cc)
    prefix = batch_prefix_len(shared_prefix_len, g)
    once = prefix_held_once(device_type, cc)
    held = prefix if once else 0                                            # prefix positions held once
    mem["gpu"] += working_bytes(config, g, P, S, dtype, cc, staged, prefix_len=prefix)
    decode_slots = _kv_slots(layout, _decode_steps(gen_len), K)
    stage_slots = _stage_slots(layout, policy)
    mem["gpu"] += L * K * _prefix_kv_bytes(config.num_key_value_heads, held, hd, e)        # prefix k/v
    for tier, h0, h1 in split_ranges(config.num_key_value_heads, policy.cache_gpu, policy.cache_cpu):
        home = 2 * _kv_bytes(g, h1 - h0, S - held, hd, dtype, cc)             # the rows' own positions
        mem[tier.value] += L * K * home
        if tier is Tier.GPU:
            continue
        if policy.cpu_attention:
            mem["cpu"] += L * K * _prefix_kv_bytes(h1 - h0, held, hd, e)      # prefix_host
        aliased = tier is Tier.CPU and not cuda and not cc
        if not policy.cpu_attention and not aliased:
            mem["gpu"] += decode_slots * home                               # kvbuf
            if tier is Tier.DISK and cuda:
                mem["cpu"] += decode_slots * home                           # kvrelay
        if cuda:
            mem["cpu"] += stage_slots * _stage_bytes(g, h1 - h0, P, hd, dtype, cc, prefix, once)   # kvstage
            mem["cpu"] += _decode_stage_bytes(layout, policy, h1 - h0, hd, dtype, gen_len)       # kvstaged
            if pipelines_host_attention(config, policy):
                mem["cpu"] += K * _host_stage_bytes(config, g, h1 - h0, e)         # hattn
    act_len = _act_home_len(P, gen_len, prefix)
    if policy.act_gpu < 1.0 and not (not cuda and policy.act_gpu + policy.act_cpu >= 1.0):
        for tier, a, b in split_ranges(config.hidden_size, policy.act_gpu, policy.act_cpu):
            if tier is Tier.GPU or (tier is Tier.CPU and not cuda):
                continue
            mem[tier.value] += K * g * act_len * (b - a) * e               # act homes
    if runs_ahead(policy, gen_len, num_prompts):
        for tier, extra in _ahead_memory(config, policy, P, gen_len, dtype, device_type, prefix).items():
            mem[tier] += extra
    return mem


def _untracked_terms(config: ModelConfig, policy: Policy, prompt_len: int, bytes_per_element: int,
                     device_type: str, shared_prefix_len: int) -> tuple[float, float, float]:
    """(bytes scaled by the gpu share of hidden states, bytes on the device whatever the placement, bytes
    scaled by the share off the gpu) of `untracked_gpu_bytes`."""
    g, K, P, e = policy.gpu_batch_size, policy.num_gpu_batches, prompt_len, bytes_per_element
    p, h, nh = batch_prefix_len(shared_prefix_len, g), config.hidden_size, config.num_attention_heads
    decode = (K - 1) * g * h * e                                # a decode step's hidden [g, 1, h]: never parked
    placed = 0.0 if p else (K - 1) * g * P * h * e - decode     # hidden [g, P, h] parked by the act placement
    kept = (K - 1) * (p + g * (P - p)) * h * e if p else decode  # the prefill's (prefix, rows) pair stays on the gpu
    # with K > 2 the next GPU batch's parked hidden, loaded a slot ahead (`runtime.schedule`) while this one
    # computes: its parts off the gpu come back into device memory the executor does not reserve, at the
    # prefill, when the decode's hiddens are not there (the larger of the two)
    ahead = max(0.0, g * P * h * e - decode) if K > 2 and not p and P > 1 and device_type != "cpu" else 0.0
    if device_type == "cpu":                                    # scores [c, nh, P - p, P]; the prefix's [1, nh, p, p]
        kept += max(chunk_rows(g, P - p) * nh * (P - p) * P, nh * p * p) * e
    return placed, kept, ahead


def untracked_gpu_bytes(config: ModelConfig, policy: Policy, prompt_len: int, bytes_per_element: int,
                        device_type: str, *, shared_prefix_len: int = 0) -> int:
    """Device memory the executor uses but does not reserve: the hidden states of the other GPU batches
    between layers (with a prefix computed once, its prefill's (prefix, rows) pairs, which are never parked;
    the prefill's by the gpu share of hidden states, a decode step's, never parked, by the rest: affine in
    act_gpu, exact at 0 and 1, above the larger of the two between), on an accelerator with K > 2 the next GPU
    batch's parked hidden loaded a slot ahead (by the share off the gpu), and on a CPU device the attention scores
    of the math SDPA path (one prefill row chunk)."""
    placed, kept, ahead = _untracked_terms(config, policy, prompt_len, bytes_per_element, device_type,
                                           shared_prefix_len)
    return int(placed * policy.act_gpu + kept + ahead * (1.0 - policy.act_gpu))


def peak_memory(config: ModelConfig, layout: ModelLayout, policy: Policy, prompt_len: int, gen_len: int,
                bytes_per_element: int, device_type: str, *, shared_prefix_len: int = 0,
                num_prompts: int | None = 1) -> dict[str, int]:
    """`executor_memory` plus the untracked device memory: what the budgets must hold."""
    mem = executor_memory(config, layout, policy, prompt_len, gen_len, bytes_per_element, device_type,
                          shared_prefix_len=shared_prefix_len, num_prompts=num_prompts)
    mem["gpu"] += untracked_gpu_bytes(config, policy, prompt_len, bytes_per_element, device_type,
                                      shared_prefix_len=shared_prefix_len)
    return mem


def memory_terms(config: ModelConfig, layout: ModelLayout, policy: Policy, prompt_len: int, gen_len: int,
                 bytes_per_element: int, device_type: str, *, shared_prefix_len: int = 0,
                 num_prompts: int | None = 1) -> dict[str, np.ndarray]:
    """`peak_memory` as affine expressions in the placement fractions (shares as fractions of bytes; an ahead
    prefill's next-block homes on the tier of the share, its gpu share parked on the cpu)."""
    dtype, e = dtype_of_size(bytes_per_element), bytes_per_element
    cuda = device_type == "cuda"
    g, K, L = policy.gpu_batch_size, policy.num_gpu_batches, len(layout.attention_js)
    P, S, hd, nkv = prompt_len, prompt_len + gen_len - 1, config.head_dim, config.num_key_value_heads
    cc = policy.compress_cache
    # every streamed tensor off the gpu: all of them once the share off the gpu is 1 - held_fraction
    held, held_kinds = layout.held_fraction(device_type), layout.held(device_type)
    streamed = _buffer_bytes(layout, lambda kl, n: kl.stored[n] * (kl.kind not in held_kinds))
    buffers = streamed / (1.0 - held) if held < 1.0 else 0.0
    dequant = _buffer_bytes(layout, lambda kl, n: kl.dense[n] * kl.packed[n], slotted=False)
    prefix = batch_prefix_len(shared_prefix_len, g)
    once = prefix_held_once(device_type, cc)
    held = prefix if once else 0                                            # prefix positions held once
    home = 2 * _kv_bytes(g, nkv, S - held, hd, dtype, cc)                    # one (layer, batch) cache, own positions
    prefix_kv = L * K * _prefix_kv_bytes(nkv, held, hd, e)                  # the shared prefix's k/v, dense
    stage = _stage_bytes(g, nkv, P, hd, dtype, cc, prefix, once)
    staged = 2 * g * nkv * P * hd * e                                       # prefill k/v awaiting store_cache
    decode_slots = _kv_slots(layout, _decode_steps(gen_len), K)
    stage_slots = _stage_slots(layout, policy)
    hidden = K * g * _act_home_len(P, gen_len, prefix) * config.hidden_size * e
    placed, kept, ahead = _untracked_terms(config, policy, P, e, device_type, shared_prefix_len)
    w_moved = share("w", "off") if cuda else share("w", "disk")
    c_loaded = share("cache", "off") if (cuda or cc) else share("cache", "disk")
    gpu = (share("w", "gpu") * layout.total_bytes + w_moved * buffers + const(dequant)
           + share("cache", "gpu") * (L * K * home)
           + (c_loaded * (decode_slots * home) if not policy.cpu_attention else const(0.0))
           + const(working_bytes(config, g, P, S, dtype, cc, prefix_len=prefix))
           + c_loaded * staged
           + share("act", "gpu") * placed + const(kept) + share("act", "off") * ahead + const(prefix_kv))
    cpu = share("w", "cpu") * layout.total_bytes + share("cache", "cpu") * (L * K * home)
    if policy.cpu_attention:
        cpu = cpu + share("cache", "off") * prefix_kv                       # host copies for host attention
    if cuda:
        if pipelines_host_attention(config, policy):
            cpu = cpu + share("cache", "off") * (K * _host_stage_bytes(config, g, nkv, e))
        stages = stage_slots * stage + _decode_stage_bytes(layout, policy, nkv, hd, dtype, gen_len)
        cpu = (cpu + share("w", "disk") * buffers + share("cache", "off") * stages
               + share("act", "cpu") * hidden
               + (share("cache", "disk") * (decode_slots * home) if not policy.cpu_attention else const(0.0)))
    disk = share("w", "disk") * layout.total_bytes + share("cache", "disk") * (L * K * home)
    disk = disk + share("act", "disk") * hidden
    if runs_ahead(policy, gen_len, num_prompts):
        per = min(rows_per_pass(policy.block_size, gen_len - 1), g)
        staged_all = staged_kv_heads(nkv, 0.0, 1.0, device_type, cc)
        gpu = gpu + const(working_bytes(config, per, P, S, dtype, cc, staged_all, prefix_len=prefix))
        gpu = gpu + const(L * K * _prefix_kv_bytes(nkv, prefix, hd, e))          # kvpark.{j}.{k}.prefix
        ahead_stage = _ahead_stage_bytes(per, nkv, P, prefix, held, hd, dtype, cc, L) if cuda else 0
        cpu = cpu + (share("cache", "gpu") + share("cache", "cpu")) * (L * K * home) + const(ahead_stage)
        disk = disk + share("cache", "disk") * (L * K * home)
    return {"gpu": gpu, "cpu": cpu, "disk": disk}


def weight_fraction_on(layout: ModelLayout, w_gpu: float, w_cpu: float, device_type: str = "cpu",
                       extra: int = 0) -> tuple[float, float]:
    """(gpu, cpu) fractions of all weight bytes the executor places for these policy fractions and `extra`
    (`Policy.w_gpu_extra`) on a `device_type` device (on CUDA the held kinds count on the gpu)."""
    on = layout.bytes_on(layout.placed(w_gpu, w_cpu, device_type, extra))
    total = layout.total_bytes or 1
    return on[Tier.GPU] / total, on[Tier.CPU] / total


def split_fraction_on(n: int, gpu: float, cpu: float) -> tuple[float, float]:
    """(gpu, cpu) fractions of n items (kv heads, hidden features) `split_ranges` puts on each tier."""
    on = {t: 0 for t in Tier}
    for tier, a, b in split_ranges(n, gpu, cpu):
        on[tier] += b - a
    return on[Tier.GPU] / n, on[Tier.CPU] / n


def realized_placement(config: ModelConfig, layout: ModelLayout, policy: Policy,
                       device_type: str = "cpu") -> np.ndarray:
    """The fractions of bytes [6] (VARS order) the executor really puts on gpu/cpu for `policy` on a
    `device_type` device."""
    wg, wc = weight_fraction_on(layout, policy.w_gpu, policy.w_cpu, device_type, policy.w_gpu_extra)
    cg, ccpu = split_fraction_on(config.num_key_value_heads, policy.cache_gpu, policy.cache_cpu)
    ag, ac = split_fraction_on(config.hidden_size, policy.act_gpu, policy.act_cpu)
    return np.array([wg, wc, cg, ccpu, ag, ac])


def weight_settings(layout: ModelLayout) -> list[float]:
    """Policy weight fractions giving every distinct placement once, ascending: 0, just past each tensor
    midpoint, 1 (a placement that 0 or 1 already gives is represented by 0 or 1)."""
    values = sorted({0.0, 1.0, *(m + _STEP for m in layout.midpoints if m + _STEP < 1.0)})
    by_realized: dict[float, float] = {}
    for v in values:
        r = weight_fraction_on(layout, v, 0.0)[0]
        if r not in by_realized or v in (0.0, 1.0):
            by_realized[r] = v
    return sorted(by_realized.values())
