"""FlexGen's analytical cost model, extended with MoE-Lightning's roofline terms. Pure functions.

For one batch shape and flag set (a `Policy`'s gpu_batch_size, num_gpu_batches and flags), `cost_terms`
returns affine expressions (see `affine`) in the placement fractions:
  - per decoder layer, the busy time of each channel during prefill and during one decode step
    (cpu->gpu, gpu->cpu, disk->cpu, cpu->disk, gpu compute, host);
  - the peak bytes held on each tier, as the executor counts them (`memory.memory_terms`).
A layer's time is the max over its channels when `overlap` (Algorithm 1's six threads), else their sum.
"host" is the executor's own time per (decoder layer, GPU batch) slot, measured on the real executor: many
small GPU batches cost what they really cost. It depends on what a slot does (`SlotCosts`): the resident
path, plus an extra for a 4-bit cache segment on the gpu, for a cache segment off the gpu (loaded, staged
and stored around a GPU attention, or attended on the host) and for weights off the gpu (a page of
copies); 4-bit weights add host time once per layer and step. Each
extra is a step in the placement (any share off the gpu pays it), so it is not affine: the terms keep it
apart (`CostTerms.*_slots`), `estimate_terms` adds it at the exact placement, and the search solves one LP
per slot regime (`SlotCosts.regime_seconds`). With CPU attention the executor waits for each GPU batch's q/k/v, attends
on the host and then launches the rest of the layer, so gpu work, host attention (at the measured
`cpu_decode_attention` rate) and slot latencies add up in one "compute" channel, unless the MoE pipeline
runs (`buffers.pipelines_host_attention`: MoE-Lightning's CGOPipe, `engine.runtime.moe_schedule`): then the host
attends GPU batch k on its own thread while the device runs the MoE layers of the batches before it, so gpu
work G and host attention A overlap up to a bubble of one GPU batch's share of the other (the first batch's
attention and the last batch's experts have nothing to hide behind): channels "gpu compute" G + A / k and
"cpu attention" A + G / k; the executor's slot work joins the "cpu attention" channel, since it runs on the
cores the host attention's threads hold. A MoE slot with host attention, pipelined or not, costs the executor
`HardwareProfile.moe_cpu_attention_slot_ms` (job start and join, the router's sync; measured), each weight page
past one per GPU batch `weight_page_ms`; and each GPU batch's attention output waits on average half a weight
page (`weight_pages`) behind the layer's weight transfer on the link, added to G.
On a CPU device the host is the device: host time adds to compute.
A block of bls = gpu_batch_size x num_gpu_batches sequences takes
    T = L * T_pre + L * (n - 1) * T_gen,   throughput = bls * n / T   (generated tokens per second).
With `Policy.prefill_ahead` over B > 1 blocks (`buffers.runs_ahead`), every prefill but the first runs on the
previous block's decode steps: each block but the last carries one prefill, whose gpu compute and cache
stores (and its gpu cache share moved up at the switch) join each of its decode layer-steps' channels,
divided over the n - 1 steps; T_gen is the mean over the blocks of the carrying and the plain step, each the
max of its own channels (`CostTerms.decode_step`; the LP sees the mean channels), and T_pre counts 1 / B (0
when the rows are unbounded: every block carries). The prefill's compute joins the host channel too: the
slot work does not hide behind it (`decode_slack`). A shared prefix runs ahead too, computed once per GPU batch.
With a shared prompt prefix of p tokens (`Workload.shared_prefix_len`, `prefix.batch_prefix_len`) a GPU
batch's prefill computes the prefix once and each row's own s - p tokens after it; where the prefix's keys
and values are held once per GPU batch (`prefix.prefix_held_once`: an accelerator or a 4-bit cache), the KV
cache, its stores, its quantization and the decode's cache traffic count each row's own positions
(s - p + n / 2 on average; a decode load moves a row's written positions, its padded prompt and the tokens so
far), while attention still reads the mean context ctx; the prefill's hidden state is
not parked. A decode step's hidden states never leave the gpu (`engine.runtime.act_homes`): the act placement
moves only the prefill's, and of those only k - 1 GPU batches' per layer (the prefill's snake order,
`engine.runtime.schedule.batch_order`, keeps the batch computed last in a layer on the device for the next).
Symbols: L layers, b = bls, g = gpu_batch_size, k = num_gpu_batches, s prompt length, n tokens generated,
ctx = s + n / 2 the mean decode context (the KV cache grows from s to s + n), W a layer's stored weight
bytes as the executor stores them (embed and head spread over the L layers), kv / kv16 the KV bytes per
token per layer stored / uncompressed, hb the hidden bytes per token. Compressed tensors (4-bit) move
0.28x the bytes and cost a device dequantization pass at the measured rate (weights once per layer and
step; a compressed cache on every read).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from engine.policy import model_stats as ms
from engine.policy.affine import const, evaluate, share
from engine.policy.buffers import pipelines_host_attention, runs_ahead
from engine.policy.hardware import GIB, HardwareProfile
from engine.policy.layout import ModelConfig, ModelLayout
from engine.policy.memory import TIERS, memory_terms, peak_memory, realized_placement
from engine.policy.policy import Policy
from engine.policy.prefix import batch_prefix_len, prefix_held_once


@dataclass(frozen=True)
class Workload:
    """What one run asks for: `prompt_len` the mean (padded) prompt length used for time, `max_prompt_len`
    the longest one used for memory (defaults to prompt_len), `gen_len` new tokens per sequence,
    `num_prompts` the number of sequences (bounds the block size; None: unbounded).

    `shared_prefix_len`: leading tokens every prompt of the run shares (a system prompt, few-shot examples;
    included in prompt_len). The executor computes them once per GPU batch at prefill when there are at least
    `prefix.MIN_SHARED_PREFIX` and the batch has more than one row (`prefix.batch_prefix_len`); their keys and
    values are then held once per GPU batch (dense, on the device), the rows' caches hold their own
    positions only, and the prefill's hidden state stays on the device (see `prefix`)."""

    prompt_len: int
    gen_len: int
    num_prompts: int | None = None
    max_prompt_len: int | None = None
    shared_prefix_len: int = 0

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.gen_len < 1:
            raise ValueError(f"Workload: prompt_len and gen_len must be >= 1, got {self.prompt_len}, {self.gen_len}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"Workload.num_prompts must be >= 1, got {self.num_prompts}")
        if not 0 <= self.shared_prefix_len < self.prompt_len:
            raise ValueError(f"Workload.shared_prefix_len must be >= 0 and below prompt_len {self.prompt_len} "
                             f"(every prompt keeps a token of its own), got {self.shared_prefix_len}")

    @property
    def memory_prompt_len(self) -> int:
        return max(self.prompt_len, self.max_prompt_len or 0)


_ANY = 1e-9            # a share above this is "some of it"


@dataclass(frozen=True)
class SlotCosts:
    """Executor host seconds per (decoder layer, GPU batch) slot of one step: `base` on the resident path,
    plus what a slot pays for each feature present: `gpu_cache` a 4-bit cache segment on the gpu (quantize
    the new k/v, dequantize for attention), `off_cache` a cache segment off the gpu (loaded, dequantized,
    staged and stored around GPU attention; or sent to the host with CPU attention), `off_weights` weights
    off the gpu (a page of copies into the layer's device buffer). Hidden states cost a decode slot nothing:
    a decode step's never leave the gpu (`engine.runtime.act_homes`)."""

    base: float
    gpu_cache: float = 0.0
    off_cache: float = 0.0
    off_weights: float = 0.0

    def seconds(self, x: np.ndarray) -> float:
        """Per-slot seconds at placement x [6] (VARS order): each feature's extra once any share has it."""
        return (self.base + self.gpu_cache * (x[2] > _ANY) + self.off_cache * (x[2] < 1.0 - _ANY)
                + self.off_weights * (x[0] < 1.0 - _ANY))

    def regime_seconds(self, resident: bool) -> float:
        """The LP's per-slot charge: the whole cache and every hidden state on the gpu (`resident`), or
        every feature paid (the LP of that regime is free to offload; its realizations are re-costed).
        Weights may leave the gpu in both regimes: their extra is always charged."""
        if resident:
            return self.base + self.gpu_cache + self.off_weights
        return self.base + self.gpu_cache + self.off_cache + self.off_weights


@dataclass(frozen=True)
class CostTerms:
    """Affine expressions for one batch shape: seconds per layer by channel (the executor's slot time
    apart: `prefill_slots` / `decode_slots` per slot, `num_gpu_batches` slots per layer, added to the
    channel `host_channel[phase]`), peak bytes by tier."""

    prefill: dict[str, np.ndarray]
    decode: dict[str, np.ndarray]
    memory: dict[str, np.ndarray]
    num_layers: int
    gen_len: int
    block_size: int
    overlap: bool
    prefill_slots: SlotCosts = SlotCosts(0.0)
    decode_slots: SlotCosts = SlotCosts(0.0)
    num_gpu_batches: int = 1
    host_channel: tuple[str, str] = ("host", "host")        # (prefill, decode)
    layer_host_s: float = 0.0                               # host seconds per layer and step, not per slot
    w_gpu_min: float = 0.0                                  # the gpu share of weights held whatever the policy
    prefill_in_series: float = 1.0                          # a block's share of a prefill not hidden (ahead)
    rows_filled: float = 1.0                                # `rows_filled`: the workload's rows over its blocks'
    ahead: dict[str, np.ndarray] | None = None              # a decode layer-step's added channels, carrying

    @property
    def carrying(self) -> float:
        """The share of blocks whose decode carries the next block's prefill (all but the first's in series)."""
        return 1.0 - self.prefill_in_series

    def channels(self, phase: str, slot_s: float, carried: float | None = None) -> dict[str, np.ndarray]:
        """`phase`'s ("prefill" / "decode") channels with `slot_s` seconds per slot (and the per-layer host
        time) added where slots run. A decode's carry `carried` x the next block's ahead prefill (`ahead`):
        default `carrying`, the mean over the blocks (the LP's affine view)."""
        channels = dict(self.prefill if phase == "prefill" else self.decode)
        name = self.host_channel[0 if phase == "prefill" else 1]
        host = self.num_gpu_batches * slot_s + self.layer_host_s
        channels[name] = channels.get(name, const(0.0)) + const(host)
        share = self.carrying if carried is None else carried
        if phase == "decode" and self.ahead and share:
            for channel, expr in self.ahead.items():
                channels[channel] = channels.get(channel, const(0.0)) + share * expr
        return channels

    def at(self, x: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(prefill, decode) channels with the slot time of placement x [6] included."""
        return (self.channels("prefill", self.prefill_slots.seconds(x)),
                self.channels("decode", self.decode_slots.seconds(x)))

    def decode_step(self, x: np.ndarray) -> tuple[float, str]:
        """(seconds, bottleneck channel) of a decode layer-step at placement x, over the blocks: a block
        carrying the next one's prefill takes the larger of its channels with all of that prefill's share,
        one carrying none the larger without it. (The mean of the two maxima: the max of the mean channels,
        `at`, hides a carried prefill in the slack of the blocks that carry none.)"""
        slot_s = self.decode_slots.seconds(x)
        if not self.ahead or self.carrying in (0.0, 1.0):
            return layer_seconds(self.channels("decode", slot_s), x, self.overlap)
        t_carry, worst = layer_seconds(self.channels("decode", slot_s, 1.0), x, self.overlap)
        t_plain, _ = layer_seconds(self.channels("decode", slot_s, 0.0), x, self.overlap)
        return self.carrying * t_carry + (1.0 - self.carrying) * t_plain, worst


@dataclass(frozen=True)
class CostEstimate:
    """The model's prediction for one policy: seconds per block, generated tokens/s over the workload's rows
    (`rows_filled`: a last block short of rows takes a full block's time), peak bytes per tier, and the channel
    that bounds a prefill layer / a decode layer."""

    prefill_s: float
    decode_s: float
    tokens_per_s: float
    peak_memory_bytes: dict[str, int]
    prefill_bottleneck: str
    decode_bottleneck: str

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


PAGE_BYTES = 32 << 20   # the most a MoE weight page holds: an urgent copy waits at most ~0.6 ms behind one at
# 51 GiB/s, and copies of >= 16 MiB still run at full pinned bandwidth (an H200 host's link)


def weight_pages(config: ModelConfig, layout: ModelLayout, num_gpu_batches: int, cpu_attention: bool) -> int:
    """The finest `Policy.weight_pages` the search tries for a MoE model that attends on the host (CGOPipe:
    small urgent q/k/v and output copies interleave with the weights; it also tries one page per GPU batch,
    since each page costs the executor host time): one per GPU batch at least, and enough that no page of the
    largest layer kind exceeds PAGE_BYTES. 0 (one page per GPU batch, the executor's default) for dense models and
    for GPU attention, which has no urgent copies to let through: Mixtral-8x7B at 512 x 1 with GPU attention
    decodes in 77.5 s with 27 pages and in 61.2 s with one (H200, `benchmarks/throughput/throughput.py`'s moe
    workload)."""
    if not (config.is_moe and cpu_attention):
        return 0
    largest = max(sum(kind.stored) for kind in layout.kinds)
    return max(num_gpu_batches, -(-largest // PAGE_BYTES))


def model_view(layout: ModelLayout | None, bytes_per_element: int, compress_weights: bool,
               caller: str) -> ModelLayout:
    """`layout` in `bytes_per_element`-byte elements with `compress_weights` (`ModelLayout.view`); a clear error
    without one: the policy package plans from the model's layout and builds no model."""
    if layout is None:
        raise TypeError(f"{caller}: pass the model's layout (layout=engine.runtime.layout.model_layout(config))")
    return layout.view(bytes_per_element, compress_weights)


def _roofline(flops: float, nbytes: float, peak_flops: float, bandwidth: float) -> float:
    """Seconds of a kernel bound by either compute or memory traffic (the roofline)."""
    return max(flops / peak_flops, nbytes / bandwidth)


def _expected_expert_bytes(config: ModelConfig, tokens: float, bytes_per_expert: float) -> float:
    """Expert weight bytes a GPU batch of `tokens` tokens reads: E experts, each hit with probability
    1 - (1 - k/E)^tokens under uniform routing."""
    e, k = config.num_local_experts, config.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** tokens) * bytes_per_expert


def cost_terms(config: ModelConfig, policy: Policy, workload: Workload, profile: HardwareProfile,
               bytes_per_element: int, layout: ModelLayout | None = None) -> CostTerms:
    """Channel times and tier memory, affine in the placement fractions (those of `policy` are ignored).

    `layout`: the model's (`engine.runtime.layout.model_layout`; any dtype and weight compression: the
    policy's and `bytes_per_element`'s view is taken)."""
    L, g, k = config.num_hidden_layers, policy.gpu_batch_size, policy.num_gpu_batches
    b, s, n = policy.block_size, workload.prompt_len, workload.gen_len
    ctx = workload.prompt_len + workload.gen_len / 2
    B, cw, cc = bytes_per_element, policy.compress_weights, policy.compress_cache
    cpu_att, on_cpu = policy.cpu_attention, profile.device_type == "cpu"
    layout = model_view(layout, B, cw, "cost_terms")
    h2d, d2h = profile.h2d_gib_s * GIB, profile.d2h_gib_s * GIB
    d_read, d_write = profile.disk_read_gib_s * GIB, profile.disk_write_gib_s * GIB
    gpu_flops, gpu_bw = profile.gpu_tflops_bf16 * 1e12, profile.gpu_mem_gib_s * GIB
    cpu_flops, dq_bw = profile.cpu_gflops * 1e9, profile.dequant_bytes_s
    cpu_att_bw = profile.cpu_attention_q4_bytes_s if cc else profile.cpu_attention_bytes_s

    W = layout.total_bytes / L                                      # stored bytes moved per layer (edge spread)
    W16 = ms.layer_dense_bytes(config, B) + ms.edge_weight_bytes(config, B) / L   # bytes the matmuls read
    Wq = sum(k_.count * sum(d for d, p in zip(k_.dense, k_.packed) if p) for k_ in layout.kinds) / L
    kv, kv16 = ms.kv_bytes_per_token(config, B, cc), ms.kv_bytes_per_token(config, B)
    hb = ms.hidden_bytes_per_token(config, B)
    act_bytes = ms.activation_bytes_per_token(config, B)
    q_bytes = config.num_attention_heads * config.head_dim * B      # one token's q (or attention output)
    mm = ms.matmul_flops_per_token(config) + ms.head_flops_per_token(config) / L

    def weight_read(tokens: float) -> float:
        """Bytes of weights one GPU batch of `tokens` tokens reads from gpu memory in one layer."""
        if not config.is_moe:
            return W16
        per_expert = ms.expert_numel(config) * B
        dense = W16 - config.num_local_experts * per_expert
        return dense + _expected_expert_bytes(config, tokens, per_expert)

    # a shared prefix: computed once per GPU batch, each row's own sx tokens after it (`prefix`)
    p = batch_prefix_len(workload.shared_prefix_len, g)
    sx = s - p
    held = p if prefix_held_once(profile.device_type, cc) else 0   # prefix positions held once, not per row
    sx_own, ctx_own = s - held, ctx - held   # the positions a row's own cache stores / holds on average
    # a decode load copies a row's written positions (`KVHome.load`): the batch's padded prompt and the tokens
    # before the step's, P + i - 1 at decode step i = 1 .. n - 1
    loaded_own = workload.memory_prompt_len + max(n - 2, 0) / 2 - held
    hs = 0.0 if p else (k - 1) * g * s * hb    # prefill hidden bytes parked off the gpu per layer: the batch
    # computed last stays on it (`batch_order`), and so does a prefix pair

    def matmuls(tokens: int) -> float:
        """Seconds of one layer's matmuls over `tokens` tokens of one GPU batch (roofline over weight reads)."""
        return _roofline(tokens * mm, weight_read(tokens), gpu_flops, gpu_bw) if tokens else 0.0

    w_off, w_disk = share("w", "off"), share("w", "disk")
    c_gpu, c_off, c_disk = share("cache", "gpu"), share("cache", "off"), share("cache", "disk")
    h_off, h_disk = share("act", "off"), share("act", "disk")
    # compressed weights: dequantized once per layer and step (device pass; host launches in `host`)
    dequant_w = Wq / dq_bw
    dequant_w_host = profile.layer_q4_weights_ms * 1e-3 if Wq else 0.0    # compressed or int4-checkpoint weights

    # ---- prefill, one layer, whole block ----
    prefill = {
        # weights not on gpu (cpu + disk) + hidden states of the block not on gpu
        "cpu->gpu": (W * w_off + hs * h_off) / h2d,
        # the new KV cache not homed on gpu (the positions each row stores, sx_own) + hidden stored off gpu
        "gpu->cpu": (b * sx_own * kv * c_off + hs * h_off) / d2h,
        # disk weights and disk hidden states, read into cpu relay buffers
        "disk->cpu": (W * w_disk + hs * h_disk) / d_read,
        # disk share of the new cache and of the hidden states
        "cpu->disk": (b * sx_own * kv * c_disk + hs * h_disk) / d_write,
        # matmuls per GPU batch: the prefix's p tokens once, the rows' g * sx (roofline over weight reads;
        # a MoE prefix's tokens reach the experts once); causal attention (mean context: the prefix p / 2,
        # a row's own tokens p + sx / 2 over the prefix keys and their own); dequantizing weights;
        # quantizing the new cache (the positions each row stores: sx_own); the elementwise passes over every
        # token's activations (`activation_bytes_per_token`)
        "gpu compute": const(
            k * (matmuls(p) + matmuls(g * sx))
            + (k * p * ms.attention_flops_per_token(config, p / 2)
               + b * sx * ms.attention_flops_per_token(config, p + sx / 2)) / gpu_flops
            + dequant_w + (b * sx_own * kv16 / dq_bw if cc else 0.0)
            + (k * p + b * sx) * act_bytes / gpu_bw
        ),
    }

    # ---- decode, one layer, one step averaged over the n - 1 steps ----
    per_position = max(kv16 / gpu_bw, ms.attention_flops_per_token(config, 1.0) / gpu_flops)
    attn_cpu_s = b * ctx * max(kv16 / cpu_att_bw, ms.attention_flops_per_token(config, 1.0) / cpu_flops)
    fused = profile.gpu_q4_attention_s(config.num_key_value_heads, config.num_attention_heads) \
        if cc and not on_cpu else None
    if fused is not None:
        # a 4-bit cache's own positions by the fused kernel at its measured costs (it reads the packed cache:
        # no dequantizing pass), a prefix held once by the roofline (batched GEMMs over all rows)
        attn_gpu_s, dequant_cache_s = b * ctx_own * fused + b * held * per_position, 0.0
    else:
        # the roofline over every position, and a compressed cache dequantized on the device first
        attn_gpu_s = b * ctx * per_position
        dequant_cache_s = b * ctx_own * kv16 / dq_bw if cc else 0.0
    kv_to_cpu = (q_bytes + kv) if cpu_att else kv                    # cpu attention ships q with new k/v
    decode = {
        # offloaded weights + (gpu attention) the offloaded cache's written positions, (cpu attention) the
        # attention output back (a decode step's hidden states never leave the gpu: `act_homes`)
        "cpu->gpu": (W * w_off + (b * q_bytes if cpu_att else b * loaded_own * kv) * c_off) / h2d,
        # the new token's k/v (and q with cpu attention) for the offloaded cache
        "gpu->cpu": (b * kv_to_cpu * c_off) / d2h,
        # disk weights, the disk cache's written positions
        "disk->cpu": (W * w_disk + b * loaded_own * kv * c_disk) / d_read,
        # the new token's k/v homed on disk
        "cpu->disk": (b * kv * c_disk) / d_write,
    }
    # matmuls per GPU batch (roofline) + dequantization of the weights + the elementwise passes
    matmul_s = k * _roofline(g * mm, weight_read(g), gpu_flops, gpu_bw) + dequant_w + b * act_bytes / gpu_bw
    pipelined = cpu_att and pipelines_host_attention(config, policy) and not on_cpu
    # MoE with host attention: each GPU batch's attention output crosses the link behind, on average, half
    # a weight page (`moe_schedule`: the policy's pages pipelined, one whole layer without the pipeline)
    pages = (policy.weight_pages or k) if policy.pipeline else 1
    wait_w = w_off * (0.5 * k * W / (pages * h2d)) if cpu_att and config.is_moe and not on_cpu else const(0.0)
    if pipelined:
        # CGOPipe: G + A / k and A + G / k (a layer costs max(G, A) + min(G, A) / k)
        gpu = const(matmul_s) + (attn_gpu_s + dequant_cache_s) * c_gpu + wait_w
        host_att = attn_cpu_s * c_off
        decode["gpu compute"] = gpu + host_att * (1.0 / k)
        decode["cpu attention"] = host_att + gpu * (1.0 / k)
    elif cpu_att:
        # the executor waits for each GPU batch's q/k/v before attending on the host, and launches the
        # rest of the layer after it: gpu work, host attention and per-slot latencies (added by
        # CostTerms.channels) add up
        decode["compute"] = const(matmul_s) + (attn_gpu_s + dequant_cache_s) * c_gpu + attn_cpu_s * c_off + wait_w
    else:
        # gpu attention over the whole cache (moved in as needed), dequantized first when compressed
        decode["gpu compute"] = const(matmul_s + attn_gpu_s + dequant_cache_s)
    # the executor's host time, per (decoder layer, GPU batch) slot (on a CPU device it is the compute); with
    # pipelined host attention it shares the host's cores with that attention (a step takes the compute
    # thread's own time plus its waits for the host jobs), so it joins the "cpu attention" channel
    if cpu_att and not pipelined:
        host = "compute"
    elif on_cpu:
        host = "gpu compute"
    else:
        host = "cpu attention" if pipelined else "host"
    gpu_cache_slot, off_cache_slot, off_weights_slot = profile.decode_slot_extras_s(compressed_cache=cc,
                                                                                    cpu_attention=cpu_att)
    if cpu_att and config.is_moe and not on_cpu:
        off_cache_slot = profile.moe_cpu_attention_slot_s
    # a slot issues one weight page; a MoE layer paged finer issues pages - k more per decoder layer
    extra_pages = max(0, pages - k) if config.is_moe else 0
    off_weights_slot += extra_pages * profile.weight_page_s / k
    decode_slots = SlotCosts(profile.decode_slot_s, gpu_cache_slot, off_cache_slot, off_weights_slot)
    prefill_slots = SlotCosts(profile.prefill_slot_s)

    memory = memory_terms(config, layout, policy, workload.memory_prompt_len, n, B, profile.device_type,
                          shared_prefix_len=workload.shared_prefix_len, num_prompts=workload.num_prompts)
    in_series, ahead = 1.0, None
    if runs_ahead(policy, n, workload.num_prompts):
        # every block's prefill but the first rides on the previous block's decode steps (engine.runtime.ahead):
        # its compute and its cache stores spread over them, its gpu cache share moved up once at the switch;
        # only the first block's prefill stays in series (1 / blocks of a prefill per block), and every block
        # but the last carries one (`CostTerms.decode_step`)
        blocks = -(-workload.num_prompts // b) if workload.num_prompts is not None else None
        in_series = 0.0 if blocks is None else 1.0 / blocks
        compute = "compute" if "compute" in decode else "gpu compute"
        carried = prefill["gpu compute"] / (n - 1)         # a carrying block's step: all of one prefill's share
        ahead = {compute: carried, "gpu->cpu": const(b * s * kv / (d2h * (n - 1))),
                 "cpu->gpu": c_gpu * (b * s * kv / (h2d * (n - 1)))}
        if host != compute:
            # the slot work does not hide behind the prefill: on Llama-3-70B at 16 GiB an ahead block takes
            # its decode's slot time plus the prefill, not the larger of the two (likely a store's host wait
            # for the staging buffer two stores back, whose copy waits for the prefill)
            ahead[host] = carried
    return CostTerms(prefill, decode, memory, L, n, b, policy.overlap, prefill_slots, decode_slots, k,
                     ("gpu compute" if on_cpu else "host", host), dequant_w_host,
                     layout.held_fraction(profile.device_type), in_series, rows_filled(b, workload.num_prompts),
                     ahead)


def rows_filled(block_size: int, num_prompts: int | None) -> float:
    """The share of its blocks' rows a run of `num_prompts` rows fills: num_prompts / (blocks x block_size), 1
    when unbounded. Its last block takes a full block's time (its steps stream every weight however few rows it
    holds; Mixtral-8x7B, 2,048 rows at 77/32/24 GiB on an H200: 1536x1 steps its 512-row block at 0.30 s, the
    1,536-row one, carrying the next block's prefill, at 0.34), so the run's tokens/s is a full block's times
    this."""
    if num_prompts is None:
        return 1.0
    return num_prompts / (-(-num_prompts // block_size) * block_size)


def layer_seconds(channels: dict[str, np.ndarray], x: np.ndarray, overlap: bool) -> tuple[float, str]:
    """(seconds, bottleneck channel) of one layer at placement x: max over channels, or their sum."""
    values = {name: evaluate(expr, x) for name, expr in channels.items()}
    worst = max(values, key=values.get)
    return (values[worst] if overlap else sum(values.values())), worst


def decode_slack(config: ModelConfig, policy: Policy, workload: Workload, profile: HardwareProfile,
                 bytes_per_element: int = 2, layout: ModelLayout | None = None) -> float:
    """The share of a decode layer-step that neither the device's compute nor the executor's slot work fills,
    at the policy's placement without the ahead prefill: the time a prefill run ahead hides in. The rest of
    that prefill adds to the decode (`cost_terms`: it joins both the compute and the host channels), so a
    block with it takes D + max(0, P - slack x D) for a plain decode D and a prefill P. 0 without overlap."""
    plain = replace(policy, prefill_ahead=False)
    if not plain.overlap:
        return 0.0
    layout = model_view(layout, bytes_per_element, plain.compress_weights, "decode_slack")
    terms = cost_terms(config, plain, workload, profile, bytes_per_element, layout)
    x = realized_placement(config, layout, plain, profile.device_type)
    _, decode = terms.at(x)
    total, _ = layer_seconds(decode, x, True)
    busy = max(float(evaluate(decode[c], x)) for c in ("gpu compute", "compute", "host", "cpu attention")
               if c in decode)                    # "cpu attention": pipelined, it holds the slot work
    return max(0.0, 1.0 - busy / total) if total > 0 else 0.0


def estimate_terms(terms: CostTerms, x: np.ndarray) -> CostEstimate:
    """Evaluate precomputed terms at placement x [6] (slot time at exactly this placement)."""
    prefill = terms.channels("prefill", terms.prefill_slots.seconds(x))
    t_pre, pre_worst = layer_seconds(prefill, x, terms.overlap)
    t_gen, gen_worst = terms.decode_step(x)
    prefill_s = terms.num_layers * t_pre * terms.prefill_in_series
    decode_s = terms.num_layers * (terms.gen_len - 1) * t_gen
    total = prefill_s + decode_s
    memory = {tier: int(max(0.0, evaluate(terms.memory[tier], x))) for tier in TIERS}
    tokens_per_s = terms.rows_filled * terms.block_size * terms.gen_len / total
    return CostEstimate(prefill_s, decode_s, tokens_per_s, memory, pre_worst, gen_worst)


def estimate(config: ModelConfig, policy: Policy, workload: Workload, profile: HardwareProfile,
             bytes_per_element: int = 2, layout: ModelLayout | None = None,
             terms: CostTerms | None = None) -> CostEstimate:
    """The model's prediction for one fully specified policy: times at the placement the executor really
    makes (tensors whole, kv heads and hidden features rounded), peak memory as the executor counts it
    plus its untracked device memory (`memory.peak_memory`). `layout`: the model's (as `cost_terms`)."""
    layout = model_view(layout, bytes_per_element, policy.compress_weights, "estimate")
    terms = terms or cost_terms(config, policy, workload, profile, bytes_per_element, layout)
    result = estimate_terms(terms, realized_placement(config, layout, policy, profile.device_type))
    peak = peak_memory(config, layout, policy, workload.memory_prompt_len, workload.gen_len, bytes_per_element,
                       profile.device_type, shared_prefix_len=workload.shared_prefix_len,
                       num_prompts=workload.num_prompts)
    return replace(result, peak_memory_bytes=peak)
