"""The buffer plan against what the executor allocates: tiny models of every family, a grid of policies, and a
run whose arena records (by name) every buffer it handed out, compared with the memory model's plan."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from engine.calibrate.trial import truncated_model
from engine.models.hf_config import config_from_hf
from engine.models.presets import PRESETS
from engine.policy.buffer_spec import BufferSpec
from engine.policy.memory import executor_memory, executor_plan, peak_memory
from engine.policy.policy import Policy
from engine.runtime.executor import Executor
from engine.runtime.layout import model_layout
from helpers.greedy_runs import RunToEnd

# a Qwen3-MoE of the preset's kind, tiny: 4 experts of 32, q/k norms, head_dim 32
TINY_QWEN_MOE = {**PRESETS["qwen3-30b-a3b"], "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 32, "vocab_size": 320, "max_position_embeddings": 256,
                 "torch_dtype": "float32"}
FAMILIES = {"opt": PRESETS["tiny-opt"], "llama": PRESETS["tiny-llama"], "mixtral": PRESETS["tiny-mixtral"],
            "qwen_moe": TINY_QWEN_MOE, "deepseek": PRESETS["tiny-deepseek-v2"]}

# (policy, shared prefix tokens, blocks): every placement of each tensor class, both compressions, host
# attention, the ahead prefill (two blocks: the second's prefill rides on the first's decode), several shapes
GRID: dict[str, tuple[Policy, int, int]] = {
    "resident": (Policy(gpu_batch_size=2, num_gpu_batches=2), 0, 1),
    "w_split_extra": (Policy(gpu_batch_size=2, num_gpu_batches=3, w_gpu=0.2, w_cpu=0.4, w_gpu_extra=2), 0, 1),
    "w_disk_4bit": (Policy(gpu_batch_size=3, num_gpu_batches=1, w_gpu=0.0, w_cpu=0.0, compress_weights=True), 0, 1),
    "cache_act_split": (Policy(gpu_batch_size=2, num_gpu_batches=3, cache_gpu=0.5, cache_cpu=0.25, act_gpu=0.5,
                               act_cpu=0.25), 0, 1),
    "cache_cpu_4bit": (Policy(gpu_batch_size=1, num_gpu_batches=2, cache_gpu=0.0, cache_cpu=1.0,
                              compress_cache=True), 0, 1),
    "cache_disk_prefix": (Policy(gpu_batch_size=2, num_gpu_batches=2, cache_gpu=0.0, cache_cpu=0.0), 5, 1),
    "cpu_attention_4bit": (Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.0,
                                  cache_cpu=0.5, cpu_attention=True, compress_cache=True), 5, 1),
    "cpu_attention": (Policy(gpu_batch_size=3, num_gpu_batches=2, cache_gpu=0.5, cache_cpu=0.5, act_gpu=0.0,
                             act_cpu=0.0, cpu_attention=True), 0, 1),
    "ahead_prefix_4bit": (Policy(gpu_batch_size=2, num_gpu_batches=2, cache_gpu=0.5, cache_cpu=0.25,
                                 compress_cache=True, compress_weights=True, prefill_ahead=True), 5, 2),
    "ahead_offloaded": (Policy(gpu_batch_size=3, num_gpu_batches=2, w_gpu=0.3, w_cpu=0.3, cache_gpu=0.0,
                               cache_cpu=1.0, act_gpu=0.5, act_cpu=0.5, prefill_ahead=True), 0, 3),
}
PROMPT, GEN = 9, 4


def family(name: str, layers: int = 2, dtype: torch.dtype = torch.float32, **sizes: int):
    """The tiny model of `name` (a FAMILIES key) with `layers` decoder layers, config fields `sizes` replaced
    (a larger one), and dummy weights."""
    return truncated_model(replace(config_from_hf(FAMILIES[name]), **sizes), layers, dtype)


def prompts(rows: int, prompt_len: int, prefix: int) -> list[list[int]]:
    """`rows` prompts of `prompt_len` tokens, the first `prefix` of them the same in every row."""
    return [[3 + (t if t < prefix else 7 * r + t) % 97 for t in range(prompt_len)] for r in range(rows)]


def run(loaded, policy: Policy, prefix: int, blocks: int, device: torch.device, disk_dir: Path,
        dtype: torch.dtype = torch.float32, gpu_memory: int | None = None, prompt_len: int = PROMPT,
        gen_len: int = GEN) -> tuple[dict[str, BufferSpec], dict[str, int], dict]:
    """`blocks` full blocks of `prompt_len`-token prompts generating `gen_len` tokens each on the real executor:
    (every buffer its arena holds at the end, by name; the most bytes it handed out of each; its memory
    report)."""
    ex = Executor(loaded, policy, device=device, dtype=dtype, disk_dir=disk_dir, gpu_memory=gpu_memory)
    try:
        rows = prompts(policy.block_size * blocks, prompt_len, prefix)
        work = [(rows[b:b + policy.block_size], [gen_len] * policy.block_size, RunToEnd())
                for b in range(0, len(rows), policy.block_size)]
        for _ in ex.generate_blocks(work):
            pass
        return dict(ex.arena.held), dict(ex.arena.asked), ex.memory_report()
    finally:
        ex.close()


def planned(loaded, policy: Policy, prefix: int, blocks: int, device_type: str, bytes_per_element: int = 4,
            prompt_len: int = PROMPT, gen_len: int = GEN, dtype: torch.dtype | None = None
            ) -> tuple[dict[str, BufferSpec], dict[str, int], dict[str, int]]:
    """(the memory model's buffers by name, its bytes per tier, its peak per tier: those and the device
    memory the executor uses without reserving it) for `run`'s workload; `dtype`: the run's, when its size
    does not say it (bfloat16)."""
    layout = model_layout(loaded.config, dtype or bytes_per_element, policy.compress_weights)
    args = (loaded.config, layout, policy, prompt_len, gen_len, bytes_per_element, device_type)
    kw = dict(shared_prefix_len=prefix, num_prompts=policy.block_size * blocks)
    return executor_plan(*args, **kw).buffers(), executor_memory(*args, **kw), peak_memory(*args, **kw)


def differences(held: dict[str, BufferSpec], asked: dict[str, int], plan: dict[str, BufferSpec]) -> list[str]:
    """Every buffer allocated but not planned, planned but not allocated, allocated unlike its plan, or never
    used whole (its largest request smaller than planned)."""
    out = [f"unplanned {name}" for name in sorted(set(held) - set(plan))]
    out += [f"never allocated {name}" for name in sorted(set(plan) - set(held))]
    for name in sorted(set(plan) & set(held)):
        want, got = replace(plan[name], owner=""), replace(held[name], owner="")
        if want != got:
            out.append(f"{name}: planned {want}, allocated {got}")
        elif asked[name] != want.nbytes:
            out.append(f"{name}: planned {want.nbytes} bytes, at most {asked[name]} used")
    return out


# the families the CUDA grid runs, larger than FAMILIES' so device memory is more than allocator rounding
_CUDA_SIZES = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=64, vocab_size=4096)
CUDA_KINDS = {"llama": _CUDA_SIZES, "mixtral": {**_CUDA_SIZES, "intermediate_size": 512}, "deepseek": {}}


def cuda_case(name: str, case: str, disk_dir: Path, prompt_len: int = 96, gen_len: int = 6) -> dict:
    """One GRID case on the family `name` (fp16, 4 layers, config fields `CUDA_KINDS[name]`) on CUDA, its budget the
    memory model's gpu peak: the plan's differences from what the executor allocated, its memory report against
    the memory model's, and torch's device peak (above what was allocated before) against that budget."""
    policy, prefix, blocks = GRID[case]
    loaded = family(name, 4, torch.float16, **CUDA_KINDS[name])
    plan, memory, peak = planned(loaded, policy, prefix, blocks, "cuda", 2, prompt_len, gen_len)
    torch.ones(64, 64, dtype=torch.float16, device="cuda") @ torch.ones(64, 64, dtype=torch.float16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    held, asked, report = run(loaded, policy, prefix, blocks, torch.device("cuda"), disk_dir, torch.float16,
                              gpu_memory=peak["gpu"], prompt_len=prompt_len, gen_len=gen_len)
    device_peak = torch.cuda.max_memory_allocated() - base
    return {"family": name, "case": case, "differences": differences(held, asked, plan),
            "report_matches": report["gpu"]["peak"] == memory["gpu"] and report["cpu"]["peak"] == memory["cpu"]
            and report["disk"]["peak"] == memory["disk"] - weight_file_bytes(plan),
            "budget_bytes": peak["gpu"], "device_peak_bytes": device_peak, "within_budget": device_peak <= peak["gpu"]}


def weight_file_bytes(plan: dict[str, BufferSpec]) -> int:
    """Bytes of the weight files on disk (mapped, not in the arena's disk budget, which holds scratch files)."""
    return sum(spec.nbytes for spec in plan.values() if spec.owner == "weight files")
