"""The roofline bound of one policy on one machine (pure arithmetic): what no schedule can beat.

Per step every layer's weights that do not live on the compute device cross the link once: the weight
floor is max(bytes off the device / h2d bandwidth, bytes on disk / disk read bandwidth), with the bytes
from the executor's own placement (`memory.weight_fraction_on`: whole tensors per tier, the embedding and
the head held on a GPU; on a CPU-only machine the cpu tier is compute memory, so only disk bytes move).
A decode step with GPU attention over a cache homed off the device also moves that cache's attended
positions over the same link (the rows' own positions: a shared prefix held once stays on the device), so
its transfer floor is (weights + cache off the device) / h2d bandwidth; with CPU attention the cache stays
where it is. The compute floor is the step's matmul and attention FLOPs at the device's large-matmul rate
(prefill: every prompt token; decode: one per row). A step's floor is the larger of the two; a block's is
its prefill's plus (gen - 1) decode steps'.

    python benchmarks/throughput/roofline.py benchmarks/records/h200/throughput.jsonl   # recorded and today's fraction
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root

from engine.models.config import ModelConfig  # noqa: E402
from engine.policy import model_stats as ms  # noqa: E402
from engine.policy.hardware import GIB, HardwareProfile  # noqa: E402
from engine.policy.memory import split_fraction_on, weight_fraction_on  # noqa: E402
from engine.runtime.layout import model_layout  # noqa: E402
from engine.policy.policy import Policy  # noqa: E402
from engine.policy.prefix import batch_prefix_len, prefix_held_once  # noqa: E402


def _weight_bytes_off(config: ModelConfig, policy: Policy, profile: HardwareProfile,
                      bytes_per_element: int) -> tuple[float, float]:
    """(weight bytes off the compute device, of them on disk) for the executor's placement of `policy`."""
    layout = model_layout(config, bytes_per_element, policy.compress_weights)
    on_gpu, on_cpu = weight_fraction_on(layout, policy.w_gpu, policy.w_cpu, profile.device_type, policy.w_gpu_extra)
    return (1.0 - on_gpu) * layout.total_bytes, max(0.0, 1.0 - on_gpu - on_cpu) * layout.total_bytes


def _link_floor_s(off: float, disk: float, profile: HardwareProfile, extra_h2d_bytes: float) -> float:
    """Seconds to move `off` + `extra_h2d_bytes` bytes to the device, `disk` of them read from disk first (on a
    CPU-only machine only the disk bytes move)."""
    disk_s = disk / (profile.disk_read_gib_s * GIB)
    if profile.device_type == "cpu":
        return disk_s
    return max((off + extra_h2d_bytes) / (profile.h2d_gib_s * GIB), disk_s)


def cache_load_bytes(config: ModelConfig, policy: Policy, profile: HardwareProfile, bytes_per_element: int, *,
                     rows: int, own_context_len: float) -> float:
    """Bytes of one decode step's cache that GPU attention loads onto the device: the off-device kv heads
    of `rows` rows' own `own_context_len` positions (mean over the step) in every attention layer; 0 with
    CPU attention or on a CPU-only machine."""
    if policy.cpu_attention or profile.device_type == "cpu":
        return 0.0
    on_gpu, _ = split_fraction_on(config.num_key_value_heads, policy.cache_gpu, policy.cache_cpu)
    per_token = ms.kv_bytes_per_token(config, bytes_per_element, policy.compress_cache)   # one layer
    return rows * own_context_len * config.num_hidden_layers * per_token * (1.0 - on_gpu)


def compute_floor_s(config: ModelConfig, tokens: float, context_len: float, rows: int,
                    profile: HardwareProfile) -> float:
    """Seconds of matmul + attention FLOPs for `tokens` new tokens over `context_len` keys, plus the head for
    `rows` last positions, at the device's large-matmul rate."""
    L = config.num_hidden_layers
    flops = tokens * L * (ms.matmul_flops_per_token(config) + ms.attention_flops_per_token(config, context_len))
    flops += rows * ms.head_flops_per_token(config)
    return flops / (profile.gpu_tflops_bf16 * 1e12)


def prefill_tokens(rows: int, prompt_len: int, prefix_len: int, gpu_batch_size: int) -> int:
    """Tokens the prefill computes over `rows` rows: each row's own, and a shared prefix once per GPU batch."""
    return rows * (prompt_len - prefix_len) + -(-rows // gpu_batch_size) * prefix_len


def record_roofline(config: ModelConfig, record: dict, profile: HardwareProfile) -> dict[str, float]:
    """`roofline` of a `throughput.py` record's policy and workload (its rows, prompt, prefix, gen length)."""
    policy = Policy.from_dict(record["policy"])
    rows, prefix = record["num_prompts"], record.get("prefix_len") or 0
    return roofline(config, policy, profile, rows=rows,
                    prefill_tokens=prefill_tokens(rows, record["prompt_len"], prefix, policy.gpu_batch_size),
                    prompt_len=record["prompt_len"], gen_len=record["gen_len"], prefix_len=prefix)


def roofline(config: ModelConfig, policy: Policy, profile: HardwareProfile, *, rows: int, prefill_tokens: int,
             prompt_len: int, gen_len: int, bytes_per_element: int = 2, prefix_len: int = 0) -> dict[str, float]:
    """The floor of generating `gen_len` tokens for `rows` rows in blocks of `policy.block_size` rows (the last
    one holds the rest: 512 rows at 384 a block are 384 + 128, not two of 256): per-step weight, cache-load
    and compute floors, prefill/decode/total floor seconds (every block), and the bound in generated tokens
    per second. `prefill_tokens`: tokens the prefill computes over all rows (a shared prefix once per GPU
    batch; each block computes its rows' share); `prefix_len`: the run's shared prefix (held once on the
    device where `prefix.prefix_held_once` says, so the decode loads only the rows' own positions). With
    `policy.prefill_ahead` every block's prefill after the first is compute added to the previous block's
    decode steps; the first block's prefill stays in series (`decode_floor_step_s` is the last block's step;
    the `cache_load_step_bytes` and `decode_transfer_floor_step_s` those of a whole block)."""
    blocks = -(-rows // policy.block_size)
    sizes = [policy.block_size] * (blocks - 1) + [rows - policy.block_size * (blocks - 1)]   # rows per block
    off, disk = _weight_bytes_off(config, policy, profile, bytes_per_element)
    w = _link_floor_s(off, disk, profile, 0.0)
    held = batch_prefix_len(prefix_len, policy.gpu_batch_size) \
        if prefix_held_once(profile.device_type, policy.compress_cache) else 0

    def kv(r: int) -> float:
        """One decode step's cache bytes loaded onto the device for a block of r rows."""
        return cache_load_bytes(config, policy, profile, bytes_per_element, rows=r,
                                own_context_len=prompt_len - held + gen_len / 2)

    def step(r: int, carried_s: float = 0.0) -> float:
        """One decode step of a block of r rows, with `carried_s` of another block's prefill compute on it."""
        compute = compute_floor_s(config, r, prompt_len + gen_len / 2, r, profile) + carried_s
        return max(_link_floor_s(off, disk, profile, kv(r)), compute)

    prefill_c = compute_floor_s(config, prefill_tokens, prompt_len / 2, rows, profile)
    pre = [prefill_c * r / rows for r in sizes]                                  # each block's prefill compute
    n = gen_len - 1
    if policy.prefill_ahead and blocks > 1 and gen_len > 1:
        # every block's prefill but the first rides on the previous block's decode steps (engine.runtime.ahead),
        # a shared prefix computed once per GPU batch there as in a block's own prefill
        prefill = max(w, pre[0])
        decode = sum(n * step(r, pre[b + 1] / n) for b, r in enumerate(sizes[:-1])) + n * step(sizes[-1])
    else:
        prefill = sum(max(w, p) for p in pre)
        decode = sum(n * step(r) for r in sizes)
    total = prefill + decode
    whole = kv(sizes[0])                                                          # a whole block's step
    return {"weight_floor_step_s": w, "cache_load_step_bytes": whole,
            "decode_transfer_floor_step_s": _link_floor_s(off, disk, profile, whole),
            "prefill_compute_floor_s": prefill_c, "prefill_floor_s": prefill,
            "decode_floor_step_s": step(sizes[-1]), "decode_floor_s": decode, "floor_s": total,
            "roofline_tokens_per_s": rows * gen_len / total if total > 0 else None, "blocks": blocks,
            "block_rows": sizes}


def refloor(record: dict) -> dict[str, float] | None:
    """A finished `throughput.py` record's floor under this module's roofline (the h200 reference profile its
    records were measured against), for records written before a correction of the floor: its `floor_s`, the
    recorded fraction and the fraction now. None for a peer's record (another system's policy) or one without
    a measured total."""
    import dataclasses

    from engine.models.hf_config import config_from_hf
    from engine.models.presets import PRESETS
    from engine.policy.hardware import reference_profile

    ours = str(record.get("system", "")).startswith("llmops")
    if not (ours and record.get("ok") and record.get("tokens_per_s") and record.get("model") in PRESETS):
        return None
    config = config_from_hf(PRESETS[record["model"]])
    if record.get("num_layers"):
        config = dataclasses.replace(config, num_hidden_layers=record["num_layers"])
    floor = record_roofline(config, record, reference_profile("h200"))
    total = record["generated_tokens"] / record["tokens_per_s"]
    return {"floor_s": floor["floor_s"], "recorded_fraction": record.get("roofline_fraction"),
            "fraction": floor["floor_s"] / total, "block_rows": floor["block_rows"]}


def main(argv: list[str] | None = None) -> None:
    """Print each finished record's roofline fraction, recorded and now (`refloor`)."""
    import argparse

    from benchmarks.common import read_jsonl

    ap = argparse.ArgumentParser(description="Each finished throughput record's roofline fraction, as recorded "
                                             "and under today's floor.")
    ap.add_argument("files", nargs="+", type=Path, help="throughput records (JSONL)")
    args = ap.parse_args(argv)
    for path in args.files:
        for rec in read_jsonl(path):
            now = refloor(rec)
            if now is not None:
                print(rec.get("run_id"), rec.get("system"), rec.get("config_name"),
                      f"{rec['prompt_len']}/{rec['gen_len']}/{rec['gpu_memory_gib']:g} GiB", rec.get("num_prompts"),
                      "rows; recorded",
                      None if now["recorded_fraction"] is None else round(now["recorded_fraction"], 3),
                      "now", round(now["fraction"], 3), "blocks", now["block_rows"])


if __name__ == "__main__":
    main()
