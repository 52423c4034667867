"""FlexGen's analytical cost model, extended with MoE-Lightning's roofline terms. Pure functions.

For one batch shape and flag set (a `Policy`'s gpu_batch_size, num_gpu_batches and flags), `cost_terms`
returns affine expressions (see `affine`) in the placement fractions:
  - per decoder layer, the busy time of each channel during prefill and during one decode step
    (cpu->gpu, gpu->cpu, disk->cpu, cpu->disk, gpu compute, cpu compute);
  - the peak bytes held on each tier (homes + working buffers).
A layer's time is the max over its channels when `overlap` (Algorithm 1's six threads), else their sum.
A block of bls = gpu_batch_size x num_gpu_batches sequences takes
    T = L * T_pre + L * (n - 1) * T_gen,   throughput = bls * n / T   (generated tokens per second).
Symbols: L layers, b = bls, g = gpu_batch_size, s prompt length, n tokens generated, ctx = s + n / 2 the
mean decode context (the KV cache grows from s to s + n), W a layer's stored weight bytes (embed and head
spread over the L layers), kv / kv16 the KV bytes per token per layer stored / uncompressed, hb the
hidden bytes per token. Compressed tensors (4-bit) move 0.28x the bytes and cost a dequantization pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.models.config import ModelConfig
from engine.policy import model_stats as ms
from engine.policy.affine import const, evaluate, placement_vector, share
from engine.policy.hardware import GIB, HardwareProfile
from engine.policy.policy import Policy
from engine.runtime.working import working_bytes

TIERS = ("gpu", "cpu", "disk")
_DTYPE_OF_SIZE = {2: torch.float16, 4: torch.float32, 8: torch.float64}


@dataclass(frozen=True)
class Workload:
    """What one run asks for: `prompt_len` the mean (padded) prompt length used for time, `max_prompt_len`
    the longest one used for memory (defaults to prompt_len), `gen_len` new tokens per sequence,
    `num_prompts` the number of sequences (bounds the block size; None: unbounded)."""

    prompt_len: int
    gen_len: int
    num_prompts: int | None = None
    max_prompt_len: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.gen_len < 1:
            raise ValueError(f"Workload: prompt_len and gen_len must be >= 1, got {self.prompt_len}, {self.gen_len}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"Workload.num_prompts must be >= 1, got {self.num_prompts}")

    @property
    def memory_prompt_len(self) -> int:
        return max(self.prompt_len, self.max_prompt_len or 0)


@dataclass(frozen=True)
class CostTerms:
    """Affine expressions for one batch shape: seconds per layer by channel, peak bytes by tier."""

    prefill: dict[str, np.ndarray]
    decode: dict[str, np.ndarray]
    memory: dict[str, np.ndarray]
    num_layers: int
    gen_len: int
    block_size: int
    overlap: bool


@dataclass(frozen=True)
class CostEstimate:
    """The model's prediction for one policy: seconds per block, generated tokens/s, peak bytes per tier,
    and the channel that bounds a prefill layer / a decode layer."""

    prefill_s: float
    decode_s: float
    tokens_per_s: float
    peak_memory_bytes: dict[str, int]
    prefill_bottleneck: str
    decode_bottleneck: str

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


def _roofline(flops: float, nbytes: float, peak_flops: float, bandwidth: float) -> float:
    """Seconds of a kernel bound by either compute or memory traffic (the roofline)."""
    return max(flops / peak_flops, nbytes / bandwidth)


def _expected_expert_bytes(config: ModelConfig, tokens: float, bytes_per_expert: float) -> float:
    """Expert weight bytes a GPU batch of `tokens` tokens reads: E experts, each hit with probability
    1 - (1 - k/E)^tokens under uniform routing."""
    e, k = config.num_local_experts, config.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** tokens) * bytes_per_expert


def cost_terms(config: ModelConfig, policy: Policy, workload: Workload, profile: HardwareProfile,
               bytes_per_element: int) -> CostTerms:
    """Channel times and tier memory, affine in the placement fractions (those of `policy` are ignored)."""
    L, g, k = config.num_hidden_layers, policy.gpu_batch_size, policy.num_gpu_batches
    b, s, n = policy.block_size, workload.prompt_len, workload.gen_len
    ctx = workload.prompt_len + workload.gen_len / 2
    B, cw, cc = bytes_per_element, policy.compress_weights, policy.compress_cache
    cpu_att = policy.cpu_attention
    h2d, d2h = profile.h2d_gib_s * GIB, profile.d2h_gib_s * GIB
    d_read, d_write = profile.disk_read_gib_s * GIB, profile.disk_write_gib_s * GIB
    gpu_flops, gpu_bw = profile.gpu_tflops_bf16 * 1e12, profile.gpu_mem_gib_s * GIB
    cpu_flops, cpu_bw = profile.cpu_gflops * 1e9, profile.cpu_mem_gib_s * GIB

    edge = ms.edge_weight_bytes(config, B)
    W = ms.layer_weight_bytes(config, B, cw) + edge / L             # stored bytes moved per layer
    W16 = ms.layer_weight_bytes(config, B) + edge / L               # bytes the matmuls read, uncompressed
    kv, kv16 = ms.kv_bytes_per_token(config, B, cc), ms.kv_bytes_per_token(config, B)
    hb = ms.hidden_bytes_per_token(config, B)
    q_bytes = config.num_attention_heads * config.head_dim * B      # one token's q (or attention output)
    mm = ms.matmul_flops_per_token(config) + ms.head_flops_per_token(config) / L

    def weight_read(tokens: float) -> float:
        """Bytes of weights one GPU batch of `tokens` tokens reads from gpu memory in one layer."""
        if not config.is_moe:
            return W16
        per_expert = ms.expert_numel(config) * B
        dense = W16 - config.num_local_experts * per_expert
        return dense + _expected_expert_bytes(config, tokens, per_expert)

    w_off, w_disk = share("w", "off"), share("w", "disk")
    c_gpu, c_off, c_disk = share("cache", "gpu"), share("cache", "off"), share("cache", "disk")
    h_off, h_disk = share("act", "off"), share("act", "disk")
    dequant_w = (W16 / gpu_bw) * k if cw else 0.0                   # dequantize a layer per GPU batch
    launch = k * profile.layer_overhead_ms * 1e-3                   # fixed cost per layer and GPU batch

    # ---- prefill, one layer, whole block ----
    prefill = {
        # weights not on gpu (cpu + disk) + hidden states of the block not on gpu
        "cpu->gpu": (W * w_off + b * s * hb * h_off) / h2d,
        # the new KV cache not homed on gpu + hidden states stored off gpu
        "gpu->cpu": (b * s * kv * c_off + b * s * hb * h_off) / d2h,
        # disk weights and disk hidden states, read into cpu relay buffers
        "disk->cpu": (W * w_disk + b * s * hb * h_disk) / d_read,
        # disk share of the new cache and of the hidden states
        "cpu->disk": (b * s * kv * c_disk + b * s * hb * h_disk) / d_write,
        # matmuls per GPU batch (roofline over weight reads) + causal attention (mean context s/2)
        # + dequantizing weights + quantizing the new cache + launching the layer per GPU batch
        "gpu compute": const(
            launch + k * _roofline(g * s * mm, weight_read(g * s), gpu_flops, gpu_bw)
            + b * s * ms.attention_flops_per_token(config, s / 2) / gpu_flops
            + dequant_w + (b * s * kv16 / gpu_bw if cc else 0.0)
        ),
    }

    # ---- decode, one layer, one step averaged over the n - 1 steps ----
    attn_cpu_s = b * ctx * max(kv16 / cpu_bw, ms.attention_flops_per_token(config, 1.0) / cpu_flops)
    attn_gpu_s = b * ctx * max(kv16 / gpu_bw, ms.attention_flops_per_token(config, 1.0) / gpu_flops)
    kv_to_cpu = (q_bytes + kv) if cpu_att else kv                    # cpu attention ships q with new k/v
    decode = {
        # offloaded weights + (gpu attention) the offloaded cache over mean context, (cpu attention) the
        # attention output back + offloaded hidden states
        "cpu->gpu": (W * w_off + (b * q_bytes if cpu_att else b * ctx * kv) * c_off + b * hb * h_off) / h2d,
        # the new token's k/v (and q with cpu attention) for the offloaded cache + offloaded hidden
        "gpu->cpu": (b * kv_to_cpu * c_off + b * hb * h_off) / d2h,
        # disk weights, disk cache over mean context, disk hidden
        "disk->cpu": (W * w_disk + b * ctx * kv * c_disk + b * hb * h_disk) / d_read,
        # the new token's k/v and hidden states homed on disk
        "cpu->disk": (b * kv * c_disk + b * hb * h_disk) / d_write,
    }
    # matmuls per GPU batch (roofline) + dequantization of weights (and of the cache read on gpu)
    matmul_s = launch + k * _roofline(g * mm, weight_read(g), gpu_flops, gpu_bw) + dequant_w
    if cpu_att:
        # gpu attention over the gpu-homed cache only; the cpu attends over the rest where it lives
        gpu_comp = const(matmul_s) + (attn_gpu_s * (2.0 if cc else 1.0)) * c_gpu
        cpu_comp = attn_cpu_s * c_off
        if policy.overlap and k >= 2:   # cpu attention of one GPU batch overlaps gpu work of another
            decode["gpu compute"], decode["cpu compute"] = gpu_comp, cpu_comp
        else:
            decode["compute"] = gpu_comp + cpu_comp
    else:
        # gpu attention over the whole cache (moved in as needed), dequantized first when compressed
        decode["gpu compute"] = const(matmul_s + attn_gpu_s * (2.0 if cc else 1.0))

    memory = _memory_terms(config, policy, workload, profile, bytes_per_element)
    return CostTerms(prefill, decode, memory, L, n, b, policy.overlap)


def _memory_terms(config: ModelConfig, policy: Policy, workload: Workload, profile: HardwareProfile,
                  bytes_per_element: int) -> dict[str, np.ndarray]:
    """Peak bytes per tier at the end of decoding (largest cache) plus prefill working buffers."""
    L, g, b = config.num_hidden_layers, policy.gpu_batch_size, policy.block_size
    s, n, B = workload.memory_prompt_len, workload.gen_len, bytes_per_element
    cw, cc, cpu_att = policy.compress_weights, policy.compress_cache, policy.cpu_attention
    weights = ms.layer_weight_bytes(config, B, cw) * L + ms.edge_weight_bytes(config, B)
    stage, stage16 = ms.largest_stage_bytes(config, B, cw), ms.largest_stage_bytes(config, B)
    kv, kv16 = ms.kv_bytes_per_token(config, B, cc), ms.kv_bytes_per_token(config, B)
    cache = L * b * (s + n) * kv                                    # the whole block's cache at the last step
    hidden = b * s * ms.hidden_bytes_per_token(config, B)           # the block's hidden states at one layer
    g_cache, g_hidden = g * (s + n) * kv, g * s * ms.hidden_bytes_per_token(config, B)

    nh = config.num_attention_heads
    # one GPU batch's working memory as the executor reserves it: prefill intermediates, mask, fp32
    # logits and (compressed cache) one dequantized segment
    act_work = working_bytes(config, g, s, s + n, _DTYPE_OF_SIZE[B], cc)
    if profile.device_type == "cpu":
        act_work += g * nh * s * s * B                               # the math SDPA path materializes scores

    gpu = (
        share("w", "gpu") * weights + share("cache", "gpu") * cache + share("act", "gpu") * hidden
        # two stages of offloaded weights in flight (current + prefetched), one dequantized stage
        + share("w", "off") * (2 * stage) + const(stage16 if cw else 0.0)
        # (gpu attention) the offloaded cache of two GPU batches in flight
        + share("cache", "off") * (0.0 if cpu_att else 2 * g_cache)
        # hidden states of two GPU batches in flight, and one batch's intermediates
        + share("act", "off") * (2 * g_hidden) + const(act_work)
    )
    cpu = (
        share("w", "cpu") * weights + share("cache", "cpu") * cache + share("act", "cpu") * hidden
        # pinned relay buffers for disk weights, disk cache and disk hidden states (two in flight)
        + share("w", "disk") * (2 * stage) + share("cache", "disk") * (2 * g_cache)
        + share("act", "disk") * (2 * g_hidden)
        # cpu attention: fp32 scores and an upcast copy of one batch's cache for one layer
        + const(g * nh * (s + n) * 4 + g * (s + n) * kv16 * 2 if cpu_att else 0.0)
    )
    disk = share("w", "disk") * weights + share("cache", "disk") * cache + share("act", "disk") * hidden
    return {"gpu": gpu, "cpu": cpu, "disk": disk}


def layer_seconds(channels: dict[str, np.ndarray], x: np.ndarray, overlap: bool) -> tuple[float, str]:
    """(seconds, bottleneck channel) of one layer at placement x: max over channels, or their sum."""
    values = {name: evaluate(expr, x) for name, expr in channels.items()}
    worst = max(values, key=values.get)
    return (values[worst] if overlap else sum(values.values())), worst


def estimate_terms(terms: CostTerms, x: np.ndarray) -> CostEstimate:
    """Evaluate precomputed terms at placement x [6]."""
    t_pre, pre_worst = layer_seconds(terms.prefill, x, terms.overlap)
    t_gen, gen_worst = layer_seconds(terms.decode, x, terms.overlap)
    prefill_s = terms.num_layers * t_pre
    decode_s = terms.num_layers * (terms.gen_len - 1) * t_gen
    total = prefill_s + decode_s
    memory = {tier: int(max(0.0, evaluate(terms.memory[tier], x))) for tier in TIERS}
    return CostEstimate(prefill_s, decode_s, terms.block_size * terms.gen_len / total, memory, pre_worst, gen_worst)


def estimate(config: ModelConfig, policy: Policy, workload: Workload, profile: HardwareProfile,
             bytes_per_element: int = 2) -> CostEstimate:
    """The model's prediction for one fully specified policy."""
    terms = cost_terms(config, policy, workload, profile, bytes_per_element)
    return estimate_terms(terms, placement_vector(policy))
