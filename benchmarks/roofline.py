"""The roofline bound of one policy on one machine (pure arithmetic): what no schedule can beat.

Per step every layer's weights that do not live on the compute device cross the link once: the weight
floor is max(bytes off the device / h2d bandwidth, bytes on disk / disk read bandwidth), with the bytes
from the executor's own placement (`memory.weight_fraction_on`: whole tensors per tier, the embedding and
the head held on a GPU; on a CPU-only machine the cpu tier is compute memory, so only disk bytes move). The compute floor is the step's matmul
and attention FLOPs at the device's large-matmul rate (prefill: every prompt token; decode: one per row).
A step's floor is the larger of the two; a block's is its prefill's plus (gen - 1) decode steps'.
"""
from __future__ import annotations

from engine.models.config import ModelConfig
from engine.policy import model_stats as ms
from engine.policy.hardware import GIB, HardwareProfile
from engine.policy.memory import model_layout, weight_fraction_on
from engine.policy.policy import Policy


def weight_floor_s(config: ModelConfig, policy: Policy, profile: HardwareProfile, bytes_per_element: int) -> float:
    """Seconds to move the weights that are not on the compute device once (one step's weight traffic)."""
    layout = model_layout(config, bytes_per_element, policy.compress_weights)
    on_gpu, on_cpu = weight_fraction_on(layout, policy.w_gpu, policy.w_cpu, profile.device_type)
    disk = max(0.0, 1.0 - on_gpu - on_cpu) * layout.total_bytes
    off = disk if profile.device_type == "cpu" else (1.0 - on_gpu) * layout.total_bytes
    return max(off / (profile.h2d_gib_s * GIB), disk / (profile.disk_read_gib_s * GIB))


def compute_floor_s(config: ModelConfig, tokens: float, context_len: float, rows: int,
                    profile: HardwareProfile) -> float:
    """Seconds of matmul + attention FLOPs for `tokens` new tokens over `context_len` keys, plus the head for
    `rows` last positions, at the device's large-matmul rate."""
    L = config.num_hidden_layers
    flops = tokens * L * (ms.matmul_flops_per_token(config) + ms.attention_flops_per_token(config, context_len))
    flops += rows * ms.head_flops_per_token(config)
    return flops / (profile.gpu_tflops_bf16 * 1e12)


def roofline(config: ModelConfig, policy: Policy, profile: HardwareProfile, *, rows: int, prefill_tokens: int,
             prompt_len: int, gen_len: int, bytes_per_element: int = 2) -> dict[str, float]:
    """The floor of generating `gen_len` tokens for `rows` rows in blocks of `policy.block_size`:
    per-step weight and compute floors, prefill/decode/total floor seconds (every block), and the bound in
    generated tokens per second. `prefill_tokens`: tokens the prefill computes over all rows (a shared
    prefix once per GPU batch)."""
    blocks = -(-rows // policy.block_size)
    w = weight_floor_s(config, policy, profile, bytes_per_element)
    prefill_c = compute_floor_s(config, prefill_tokens, prompt_len / 2, rows, profile)
    decode_c = compute_floor_s(config, rows, prompt_len + gen_len / 2, rows, profile) / blocks
    prefill = blocks * max(w, prefill_c / blocks)
    decode = blocks * (gen_len - 1) * max(w, decode_c / blocks)
    total = prefill + decode
    return {"weight_floor_step_s": w, "prefill_compute_floor_s": prefill_c, "prefill_floor_s": prefill,
            "decode_floor_step_s": max(w, decode_c / blocks), "decode_floor_s": decode, "floor_s": total,
            "roofline_tokens_per_s": rows * gen_len / total if total > 0 else None, "blocks": blocks}
