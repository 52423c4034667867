"""The hardware microbenchmark behind `HardwareProfile` (under a minute at the default sizes).

Each probe takes the best of a few repeats (bandwidths are upper bounds the cost model scales by).
Copies between host and device use pinned host memory; the disk probe writes a file under a temporary
folder with fsync, drops it from the page cache (posix_fadvise DONTNEED) and reads it back; the CPU
attention probe is a batched GEMV over an fp32 "cache" (q @ K^T), counting the K bytes read. Probes of
the real runtime: the executor's host time per (decoder layer, GPU batch) slot on a tiny model, the
runtime's `cpu_decode_attention` (dense and 4-bit cache, in the device's half dtype), 4-bit dequantize, and
the device's fused 4-bit decode attention (CUDA).
On a CPU device the gpu tier is the CPU: h2d/d2h are host memcpy and gpu_* are the CPU's rates.
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from engine.calibrate.machine import device_display_name, device_memory_bytes, host_memory_bytes
from engine.calibrate.trial import slot_seconds
from engine.models.attention import cpu_decode_attention
from engine.models.hf_config import config_from_hf
from engine.models.presets import PRESETS
from engine.models.quant_decode import quantized_decode_attention
from engine.policy.hardware import GIB, HardwareProfile
from engine.policy.policy import Policy
from engine.quant.config import CACHE_QUANT, WEIGHT_QUANT
from engine.quant.group import dequantize, quantize

MIB = 1024**2
# the host-CPU probes take at least this many repeats: on two H200 hosts of one kind their best of 3 read 6x
# apart (cpu_gflops 229 vs ~1400), and a short probe is cheap next to a wrong policy
HOST_REPEATS = 7
_PROBE_BATCHES = 4      # GPU batches (of one row) in the executor slot probes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Smallest wall time of `repeats` calls of fn after one warm-up, device work included."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def measure_copies(device: torch.device, size_mib: int, repeats: int) -> tuple[float, float]:
    """(host->device, device->host) GiB/s for one `size_mib` buffer (pinned host side on CUDA)."""
    numel = size_mib * MIB // 2
    pin = device.type == "cuda"
    host = torch.empty(numel, dtype=torch.float16, pin_memory=pin)
    dev = torch.empty(numel, dtype=torch.float16, device=device)
    nbytes = numel * 2
    h2d = nbytes / best_seconds(lambda: dev.copy_(host, non_blocking=pin), device, repeats) / GIB
    d2h = nbytes / best_seconds(lambda: host.copy_(dev, non_blocking=pin), device, repeats) / GIB
    return h2d, d2h


def measure_disk(disk_dir: Path | None, size_mib: int) -> tuple[float, float, int]:
    """(read GiB/s, write GiB/s, free bytes) of a file under `disk_dir` (a temp folder when None)."""
    parent = Path(disk_dir) if disk_dir else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="llmops-disk-probe-", dir=parent))
    try:
        path = folder / "probe.bin"
        block = os.urandom(MIB)
        start = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(size_mib):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        write_s = time.perf_counter() - start
        fd = os.open(path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            while os.read(fd, 16 * MIB):
                pass
            read_s = time.perf_counter() - start
        finally:
            os.close(fd)
        free = shutil.disk_usage(folder).free
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    nbytes = size_mib * MIB
    return nbytes / max(read_s, 1e-9) / GIB, nbytes / max(write_s, 1e-9) / GIB, free


def measure_matmul_tflops(device: torch.device, n: int, dtype: torch.dtype, repeats: int) -> float:
    """TFLOP/s of an n x n x n matmul in `dtype` on `device`."""
    a = torch.randn(n, n, device=device).to(dtype)  # [n, n]
    b = torch.randn(n, n, device=device).to(dtype)  # [n, n]
    seconds = best_seconds(lambda: torch.mm(a, b), device, repeats)
    return 2 * n**3 / seconds / 1e12


def measure_device_copy(device: torch.device, size_mib: int, repeats: int) -> float:
    """Device memory GiB/s: a copy of `size_mib` reads and writes that many bytes."""
    numel = size_mib * MIB // 4
    src = torch.empty(numel, device=device)
    dst = torch.empty_like(src)
    return 2 * numel * 4 / best_seconds(lambda: dst.copy_(src), device, repeats) / GIB


def measure_cpu_attention(size_mib: int, repeats: int, head_dim: int = 128, context: int = 512) -> float:
    """GiB/s of K read by a batched GEMV q [bh, 1, d] @ K^T [bh, d, s] in fp32 on the host."""
    bh = max(1, size_mib * MIB // (4 * head_dim * context))
    keys = torch.randn(bh, context, head_dim)  # [bh, s, d]
    query = torch.randn(bh, 1, head_dim)  # [bh, 1, d]
    cpu = torch.device("cpu")
    seconds = best_seconds(lambda: torch.bmm(query, keys.transpose(1, 2)), cpu, repeats)
    return keys.numel() * 4 / seconds / GIB


def measure_layer_overhead_ms(device: torch.device, iterations: int = 50) -> float:
    """Milliseconds to launch a tiny decoder-layer-like sequence of ~20 kernels (norms, 6 matmuls, rotary-
    style elementwise ops, softmax, activation, residuals): the per-layer, per-GPU-batch fixed cost."""
    x = torch.randn(1, 64, device=device)  # [b, h]
    w = torch.randn(64, 64, device=device)  # [h, h]

    def layer() -> None:
        h = torch.nn.functional.layer_norm(x, (64,))
        q, k_, v = h @ w, h @ w, h @ w
        q, k_ = q * 0.5 + k_, k_ * 0.5 - q
        p = torch.softmax(q @ k_.T, dim=-1) @ v
        h = x + p @ w
        m = torch.nn.functional.layer_norm(h, (64,))
        m = torch.relu(m @ w) * (m @ w)
        _ = h + m @ w

    def run() -> None:
        for _ in range(iterations):
            layer()

    return best_seconds(run, device, 2) / iterations * 1e3


def measure_executor_slots(device: torch.device, dtype: torch.dtype, repeats: int = 2) -> dict[str, float]:
    """Milliseconds per (decoder layer, GPU batch) slot of the real executor on a tiny OPT (`_PROBE_BATCHES` GPU
    batches of one row), as `HardwareProfile` fields: the resident path at prefill and decode, then what a decode slot
    adds with a 4-bit cache on the gpu, the cache on the cpu tier (dense or 4-bit) with GPU attention, the
    weights on the cpu tier, and the cache on the cpu tier with CPU attention (a decode step's hidden states
    never leave the gpu, whatever the act placement: nothing to measure): the host cost the cost model charges per slot (`cost_model.SlotCosts`); and what 4-bit
    weights add per layer and step. Each is the best of `repeats` runs."""
    config = config_from_hf(PRESETS["tiny-opt"])

    def slot_ms(**placement) -> tuple[float, float]:
        policy = Policy(gpu_batch_size=1, num_gpu_batches=_PROBE_BATCHES, **placement)
        runs = [slot_seconds(config, policy, device, dtype) for _ in range(repeats)]
        return min(r[0] for r in runs) * 1e3, min(r[1] for r in runs) * 1e3

    pre, dec = slot_ms()
    off = {"cache_gpu": 0.0, "cache_cpu": 1.0}

    def extra(**placement) -> float:
        return max(slot_ms(**placement)[1] - dec, 1e-3 * dec)

    return {
        "slot_prefill_ms": pre, "slot_decode_ms": dec,
        "slot_gpu_cache_q4_ms": extra(compress_cache=True),
        "slot_off_cache_ms": extra(**off),
        "slot_off_cache_q4_ms": extra(**off, compress_cache=True),
        "slot_off_weights_ms": extra(w_gpu=0.0, w_cpu=1.0),
        # weights are dequantized once per layer and step, in the first of the slots
        "layer_q4_weights_ms": _PROBE_BATCHES * extra(compress_weights=True),
        "cpu_attention_slot_ms": extra(**off, cpu_attention=True),
    }


def measure_cpu_decode_attention(dtype: torch.dtype, repeats: int, batch: int = 4, heads: int = 32,
                                 head_dim: int = 128, context: int = 512) -> tuple[float, float]:
    """(dense, 4-bit) GiB/s of K+V (dense-equivalent bytes) that the runtime's `cpu_decode_attention`
    reads, timed on a realistic shape: q [batch, heads, 1, hd] over k/v [batch, heads, context, hd]."""
    cpu = torch.device("cpu")
    q = torch.randn(batch, heads, 1, head_dim).to(dtype)                    # [b, nh, 1, hd]
    k = torch.randn(batch, heads, context, head_dim).to(dtype)              # [b, nkv, t, hd]
    v = torch.randn(batch, heads, context, head_dim).to(dtype)
    valid = torch.ones(batch, context, dtype=torch.bool)                    # [b, t]
    scale = head_dim ** -0.5
    nbytes = 2 * k.numel() * k.element_size()
    dense = best_seconds(lambda: cpu_decode_attention(q, k, v, valid, scale), cpu, repeats)
    kq, vq = quantize(k, CACHE_QUANT), quantize(v, CACHE_QUANT)
    packed = best_seconds(lambda: cpu_decode_attention(q, kq, vq, valid, scale), cpu, repeats)
    return nbytes / dense / GIB, nbytes / packed / GIB


def measure_gpu_quant_attention(device: torch.device, dtype: torch.dtype, repeats: int, batch: int = 128,
                                heads: int = 32, head_dim: int = 128, context: int = 256) -> tuple[float, float]:
    """(ns per kv-head position, ns per query-head position) of the runtime's fused 4-bit decode attention
    (`quant_decode.quantized_decode_attention`) on `device`: q [batch, heads, 1, hd] over `context` positions of a
    4-bit cache with `heads` kv heads (one query head each), then with heads / 8 (eight a group). The kernel
    loads and dequantizes each kv head's key and value once for its group and scores every query head, so a
    call takes batch x context x (kv heads x the first + heads x the second); the two timings give both.
    (0, 0) where the kernel does not run (not CUDA, no Triton)."""
    if device.type != "cuda":
        return 0.0, 0.0
    rotation = CACHE_QUANT if CACHE_QUANT.rotate else None
    per_position = {}
    for kv_heads in (heads, heads // 8):
        q = torch.randn(batch, heads, 1, head_dim, device=device).to(dtype)                   # [b, nh, 1, hd]
        k = quantize(torch.randn(batch, kv_heads, context, head_dim, device=device).to(dtype), CACHE_QUANT)
        v = quantize(torch.randn(batch, kv_heads, context, head_dim, device=device).to(dtype), CACHE_QUANT)
        valid = torch.ones(batch, context, dtype=torch.bool, device=device)                  # [b, t]

        def attend() -> torch.Tensor | None:
            return quantized_decode_attention(q, k, v, context, valid, head_dim ** -0.5, None, rotation)
        if attend() is None:
            return 0.0, 0.0
        per_position[kv_heads] = best_seconds(attend, device, repeats) / (batch * context)
    mha, grouped = per_position[heads], per_position[heads // 8]
    kv_s = max(0.0, (mha - grouped) / (heads - heads // 8))
    q_s = max(0.0, (grouped - heads // 8 * kv_s) / heads)
    return kv_s * 1e9, q_s * 1e9


def measure_dequant(device: torch.device, dtype: torch.dtype, size_mib: int, repeats: int) -> float:
    """GiB/s of dense output of the runtime's 4-bit `dequantize` on `device` (a [rows, 4096] weight)."""
    rows = max(1, size_mib * MIB // (4096 * torch.empty((), dtype=dtype).element_size()))
    w = torch.randn(rows, 4096, device=device).to(dtype)                    # [rows, 4096]
    packed = quantize(w, WEIGHT_QUANT)
    out = torch.empty_like(w)
    seconds = best_seconds(lambda: dequantize(packed, out=out), device, repeats)
    return w.numel() * w.element_size() / seconds / GIB


def measure(
    device: torch.device | str,
    *,
    size_mib: int = 256,
    disk_dir: Path | str | None = None,
    disk_size_mib: int = 256,
    matmul_n: int = 4096,
    cpu_matmul_n: int = 2048,
    repeats: int = 3,
) -> HardwareProfile:
    """Measure this machine with `device` as the gpu tier. Sizes trade accuracy for time; the defaults
    finish in well under a minute on a GPU host (tests pass small ones)."""
    device = torch.device(device)
    cpu = torch.device("cpu")
    h2d, d2h = measure_copies(device, size_mib, repeats)
    disk_read, disk_write, disk_free = measure_disk(Path(disk_dir) if disk_dir else None, disk_size_mib)
    host_repeats = max(repeats, HOST_REPEATS)
    cpu_gflops = measure_matmul_tflops(cpu, cpu_matmul_n, torch.float32, host_repeats) * 1e3
    cpu_mem = measure_cpu_attention(size_mib, host_repeats)
    overhead_ms = measure_layer_overhead_ms(device)
    half = torch.float16 if device.type == "cuda" else torch.float32
    slots = measure_executor_slots(device, half)
    att_dense, att_q4 = measure_cpu_decode_attention(half, host_repeats)
    dequant = measure_dequant(device, half, min(size_mib, 64), repeats)
    q4_kv_ns, q4_q_ns = measure_gpu_quant_attention(device, half, repeats)
    if device.type == "cuda":
        gpu_tflops = measure_matmul_tflops(device, matmul_n, torch.bfloat16, repeats)
        gpu_mem = measure_device_copy(device, size_mib, repeats)
    else:
        gpu_tflops = cpu_gflops / 1e3
        gpu_mem = measure_device_copy(cpu, size_mib, repeats)
    return HardwareProfile(
        device_name=device_display_name(device), device_type=device.type,
        h2d_gib_s=h2d, d2h_gib_s=d2h, disk_read_gib_s=disk_read, disk_write_gib_s=disk_write,
        gpu_tflops_bf16=gpu_tflops, gpu_mem_gib_s=gpu_mem, cpu_gflops=cpu_gflops, cpu_mem_gib_s=cpu_mem,
        gpu_memory_bytes=int(device_memory_bytes(device)), cpu_memory_bytes=int(host_memory_bytes()),
        disk_free_bytes=int(disk_free), layer_overhead_ms=overhead_ms, **slots, cpu_attention_gib_s=att_dense,
        cpu_attention_q4_gib_s=att_q4, dequant_gib_s=dequant, gpu_q4_attention_kv_ns=q4_kv_ns,
        gpu_q4_attention_q_ns=q4_q_ns, hostname=socket.gethostname(),
        torch_version=torch.__version__, source="measured",
    )
