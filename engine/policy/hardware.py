"""`HardwareProfile`: what one machine can move and compute (data: the cost model's input).

Units are in the field names (GiB/s are 2**30 bytes per second). The "gpu" tier is the compute device: on a
machine without a GPU it is the CPU, and h2d/d2h become host memcpy. This module only holds the profile and
the built-in reference profiles; measuring a machine (`engine.calibrate.measure`) and caching its profile as
JSON (`engine.calibrate.machine`) live in the calibrate layer above, so the policy never measures.
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any


GIB = 1024**3


# Unmeasured profiles' 4-bit host attention rate as a share of the dense one (`calibrate` measures the real
# rate). On a 2-core CPU (bf16, `ratio_to_bf16_dense` in `benchmarks/records/cpu-2core/cpu_attention_speed.jsonl`),
# attention in the rotated basis reads the rotated 4-bit cache at 0.08-0.16 of bf16 dense's dense-equivalent
# rate on the Mixtral-8x7B shape (0.08-0.10 at the default 64 MiB chunks) and 0.18-0.27 on OPT-30B's.
Q4_ATTENTION_RATIO = 1 / 8


@dataclass(frozen=True)
class HardwareProfile:
    """Bandwidths, compute rates and capacities of one machine (gpu = the compute device)."""

    device_name: str
    device_type: str                 # "cuda" or "cpu"
    h2d_gib_s: float                 # pinned host -> device copy
    d2h_gib_s: float                 # device -> pinned host copy
    disk_read_gib_s: float           # cold read of a file under the disk dir
    disk_write_gib_s: float          # write + fsync
    gpu_tflops_bf16: float           # large matmul on the compute device (bf16; fp32 on a CPU device)
    gpu_mem_gib_s: float             # device memory bandwidth (copy: read + write bytes)
    cpu_gflops: float                # host fp32 matmul
    cpu_mem_gib_s: float             # host attention-like batched GEMV, bytes of K/V read per second
    gpu_memory_bytes: int
    cpu_memory_bytes: int
    disk_free_bytes: int
    layer_overhead_ms: float = 0.3   # fixed cost of launching one layer's ~20 kernels for one GPU batch
    # Measured on the real executor and kernels (0 = not measured: derived, see the properties below)
    slot_prefill_ms: float = 0.0     # executor host time per (decoder layer, GPU batch) at prefill
    slot_decode_ms: float = 0.0      # executor host time per (decoder layer, GPU batch) per decode step
    cpu_attention_slot_ms: float = 0.0   # extra per (decoder layer, GPU batch) with CPU attention (sync, copies)
    # extra executor host time per decode slot by what the slot does (GPU attention), see SlotCosts
    slot_gpu_cache_q4_ms: float = 0.0    # a 4-bit cache segment on the gpu (quantize new k/v, dequantize)
    slot_off_cache_ms: float = 0.0       # a cache segment off the gpu: load, stage, store
    slot_off_cache_q4_ms: float = 0.0    # the same for a 4-bit cache (plus quantize and dequantize)
    slot_off_weights_ms: float = 0.0     # weights off the gpu: a page of copies into the layer buffer
    layer_q4_weights_ms: float = 0.0     # per layer and step (not slot): dequantizing 4-bit weights
    # MoE with host attention, measured on the MoE executor itself (0 = not measured)
    moe_cpu_attention_slot_ms: float = 0.0   # extra per decode slot: host job start/join, the router's host sync
    weight_page_ms: float = 0.0          # per weight page of a decoder layer beyond one per GPU batch
    cpu_attention_gib_s: float = 0.0     # cpu_decode_attention, dense K+V bytes read per second
    cpu_attention_q4_gib_s: float = 0.0  # the same over a 4-bit cache, in dense-equivalent bytes per second
    dequant_gib_s: float = 0.0           # 4-bit dequantization on the device, dense bytes written per second
    # the device's fused 4-bit decode attention (`quant_decode`), per position of one row: load and dequantize
    # one kv head's key and value, and score, weigh and sum for one query head (0 = not measured)
    gpu_q4_attention_kv_ns: float = 0.0
    gpu_q4_attention_q_ns: float = 0.0
    hostname: str = ""
    torch_version: str = ""
    source: str = "measured"         # "measured", "reference:<name>", "default", "file:<path>"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def prefill_slot_s(self) -> float:
        """Seconds of executor host time per (decoder layer, GPU batch) at prefill."""
        return (self.slot_prefill_ms or self.layer_overhead_ms) * 1e-3

    @property
    def decode_slot_s(self) -> float:
        """Seconds of executor host time per (decoder layer, GPU batch) per decode step."""
        return (self.slot_decode_ms or self.layer_overhead_ms) * 1e-3

    @property
    def cpu_attention_slot_s(self) -> float:
        """Extra seconds per (decoder layer, GPU batch) of a decode step with CPU attention (default 0.1 ms)."""
        return (self.cpu_attention_slot_ms or 0.1) * 1e-3

    def decode_slot_extras_s(self, compressed_cache: bool, cpu_attention: bool) -> tuple[float, float, float]:
        """Seconds a decode slot adds over `decode_slot_s` for (a cache segment on the gpu, a cache segment
        off the gpu, weights off the gpu) under these flags (`cost_model.SlotCosts`)."""
        gpu_cache = self.slot_gpu_cache_q4_ms * 1e-3 if compressed_cache else 0.0
        if cpu_attention:
            off_cache = self.cpu_attention_slot_s
        else:
            off_cache = (self.slot_off_cache_q4_ms if compressed_cache else self.slot_off_cache_ms) * 1e-3
        return gpu_cache, off_cache, self.slot_off_weights_ms * 1e-3

    @property
    def moe_cpu_attention_slot_s(self) -> float:
        """Extra executor host seconds per (decoder layer, GPU batch) slot of a MoE decode with host attention
        (`cost_model`): starting and joining the host job and the MoE layer's router sync, run while the host
        attention's threads hold the cores (default: `cpu_attention_slot_s`)."""
        return self.moe_cpu_attention_slot_ms * 1e-3 if self.moe_cpu_attention_slot_ms else self.cpu_attention_slot_s

    @property
    def weight_page_s(self) -> float:
        """Executor host seconds to issue one weight page of a decoder layer (its attention and MoE layers'
        slices) beyond the one page per GPU batch a slot's `slot_off_weights_ms` covers (default: that)."""
        return (self.weight_page_ms or self.slot_off_weights_ms or self.layer_overhead_ms) * 1e-3

    @property
    def cpu_attention_bytes_s(self) -> float:
        """Bytes of dense K+V per second CPU attention reads (default: the GEMV probe's rate)."""
        return (self.cpu_attention_gib_s or self.cpu_mem_gib_s) * GIB

    @property
    def cpu_attention_q4_bytes_s(self) -> float:
        """Dense-equivalent K+V bytes per second of CPU attention over a 4-bit cache (default: `Q4_ATTENTION_RATIO`
        of dense)."""
        if self.cpu_attention_q4_gib_s:
            return self.cpu_attention_q4_gib_s * GIB
        return self.cpu_attention_bytes_s * Q4_ATTENTION_RATIO

    @property
    def dequant_bytes_s(self) -> float:
        """Dense bytes per second the device's 4-bit dequantization writes (default: 1/4 of the copy rate)."""
        return self.dequant_gib_s * GIB if self.dequant_gib_s else self.gpu_mem_gib_s * GIB / 4

    def gpu_q4_attention_s(self, num_kv_heads: int, num_heads: int) -> float | None:
        """Seconds the device's fused 4-bit decode attention spends per (row, cached position) of a layer with
        these heads (each kv head's key and value dequantized once for its group, each query head scored),
        None when not measured."""
        if not (self.gpu_q4_attention_kv_ns or self.gpu_q4_attention_q_ns):
            return None
        return (num_kv_heads * self.gpu_q4_attention_kv_ns + num_heads * self.gpu_q4_attention_q_ns) * 1e-9

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HardwareProfile":
        """Build from a dict; raises ValueError naming missing/unknown fields or a wrongly typed value."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"HardwareProfile: unknown field(s) {unknown}")
        required = [n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING]
        missing = sorted(n for n in required if n not in data)
        if missing:
            raise ValueError(f"HardwareProfile: missing field(s) {missing}")
        values: dict[str, Any] = {}
        for name, value in data.items():
            kind = known[name].type
            if kind in ("float", float):
                optional = known[name].default == 0.0
                if (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
                        or (value == 0 and not optional)):
                    raise ValueError(f"HardwareProfile.{name} must be a positive number, got {value!r}")
                values[name] = float(value)
            elif kind in ("int", int):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"HardwareProfile.{name} must be a non-negative integer, got {value!r}")
                values[name] = value
            else:
                if not isinstance(value, str):
                    raise ValueError(f"HardwareProfile.{name} must be a string, got {value!r}")
                values[name] = value
        return cls(**values)


def reference_profile(name: str) -> HardwareProfile:
    """A built-in profile of a known machine. "h200": a 16-core host with one H200: pinned copies 51.4/51.5
    GiB/s, disk 1.30/1.35 GB/s, bf16 linear ~690 TFLOP/s sustained, 4.23 TB/s copy, CPU fp32 1.55 TFLOP/s,
    CPU batched GEMV ~105 GB/s, 139 GiB GPU, 126 GiB RAM, 64 GiB disk (60 GiB counted free). The 0.5 ms per
    layer and GPU batch is what FlexGen's all-on-GPU OPT-6.7B run at batch 2 implies (18 ms per decode step
    over 32 layers). The executor's host costs per slot by what the slot does (`slot_*_ms`,
    `layer_q4_weights_ms`) are `engine.calibrate.measure`'s on that host (the profile
    `benchmarks/policy/policy_validation.py` records): without them a slot over a host-resident 4-bit cache costs
    0.5 ms in the model, where it measures 4.3 ms (0.77 + 2.69 + 0.85 with the hidden states parked), and
    auto chooses many small GPU batches (Mixtral 128 x 8: under 510 tok/s against 2,189 predicted). Host
    attention's rates (dense 58.9 GiB/s, 4-bit 2.10 GiB/s dense-equivalent) are
    `measure_cpu_decode_attention`'s on that host in the same profile; with the 4-bit rate at its default,
    105 / 8 = 12.3 GiB/s, auto from this profile chooses host attention for Mixtral-8x7B at prompt 512
    (256 x 2, 626 tok/s predicted), which does not finish a 512-row block in 95 s on that host.
    `cpu_attention_q4_gib_s` likely understates the 4-bit host path, which runs 1.3-1.6x faster on a 2-core
    CPU than the code this profile measured (not measured again on this host).
    The MoE host-attention executor costs (`moe_cpu_attention_slot_ms` 2.73, `weight_page_ms` 0.42) are the
    step clock's on that host (Mixtral-8x7B 256 x 4, 27 weight pages, bf16 host cache,
    `benchmarks/throughput/throughput.py`'s moe workload): per decode step the compute thread spends 0.407 s
    in compute actions, 0.361 s issuing 27 x 32 weight pages and 0.041 s in the rest over 128 slots, then
    waits 0.504 s on host attention; without them the model predicts 2,752 tok/s for that policy, which runs
    at 719."""
    if name == "h200":
        return HardwareProfile(
            device_name="NVIDIA H200", device_type="cuda",
            h2d_gib_s=51.4, d2h_gib_s=51.5,
            disk_read_gib_s=1.30e9 / GIB, disk_write_gib_s=1.35e9 / GIB,
            gpu_tflops_bf16=690.0, gpu_mem_gib_s=4.23e12 / GIB,
            cpu_gflops=1550.0, cpu_mem_gib_s=105e9 / GIB,
            gpu_memory_bytes=139 * GIB, cpu_memory_bytes=126 * GIB, disk_free_bytes=60 * GIB,
            layer_overhead_ms=0.5, slot_prefill_ms=0.95, slot_decode_ms=0.77, slot_gpu_cache_q4_ms=1.64,
            slot_off_cache_ms=0.58, slot_off_cache_q4_ms=2.69, slot_off_weights_ms=0.95,
            layer_q4_weights_ms=0.075, cpu_attention_gib_s=58.9, cpu_attention_q4_gib_s=2.10,
            moe_cpu_attention_slot_ms=2.73, weight_page_ms=0.42,
            hostname="reference", torch_version="", source="reference:h200",
        )
    raise ValueError(f"unknown reference hardware {name!r}; known: ['h200']")
