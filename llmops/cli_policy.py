"""`llmops policy` (explain the policy the search picks) and `llmops profile` (measure this machine).

Registered in `llmops.cli` with `from llmops.cli_policy import policy_cmd, profile_cmd`. A budget no policy
fits exits with status 2 and the reason on stderr. The engine is reached through `llmops.core` only (its
planning tools come from the declared second bridge, `llmops.engine_tools`, which core re-exports).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from llmops import core


class SizeType(click.ParamType):
    """A byte size: "16GiB", "500GB", "4096"."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return core.parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


SIZE = SizeType()


def _pick_profile(profile_file: Path | None, hardware: str | None):
    """(profile, description) from --profile, --hardware, or this machine (the reference H200 without a GPU)."""
    if profile_file is not None:
        profile = core.load_profile(profile_file)
        return profile, f"file {profile_file} ({profile.device_name})"
    if hardware is None:
        hardware = "local" if core.cuda_available() else "h200"
    if hardware == "local":
        device = "cuda" if core.cuda_available() else "cpu"
        profile = core.load_or_measure(device)
        return profile, f"this machine, measured ({profile.device_name})"
    profile = core.reference_profile(hardware)
    return profile, f"built-in reference {hardware} ({profile.device_name})"


def _no_fit_hint(model: str, budgets: Any, compressing: bool) -> str:
    """What to try when no policy fits: a cpu budget the weights fit in, a disk tier, 4-bit weights."""
    size = next((r.get("bytes") for r in core.engine_models() if r.get("name") == model and r.get("bytes")), None)
    tips = []
    if size:
        gib = 2 ** 30
        need = max(32, -(-int(size * 1.25 / 0.9) // (32 * gib)) * 32)   # weights + cache, 90% usable
        if need * gib > budgets.cpu_bytes:
            tips.append(f"--cpu-memory {need}GiB (the weights are {core.format_size(size)})")
    if not budgets.disk_bytes:
        tips.append("--disk-memory 200GiB (weights streamed from disk)")
    if not compressing:
        tips.append("--allow-compression (4-bit weights, ~1/4 of the size)")
    return "hint: try " + "; or ".join(tips) if tips else "hint: raise the budgets or shorten --prompt-len/--gen-len"


POLICY_EXAMPLE = """
\b
Example:
  llmops policy --model opt-30b --gpu-memory 16GiB --cpu-memory 100GiB \\
      --disk-memory 500GiB --prompt-len 512 --gen-len 32
  llmops policy --model mixtral-8x7b --gpu-memory 24GiB --cpu-memory 128GiB --json
  llmops policy --model llama-3-70b --gpu-memory 16GiB --allow-compression --gpus 2
  llmops policy --model llama-3-70b --gpu-memory 16GiB --cpu-memory 100GiB --compress-weights \
      --compress-cache --prompt-len 200 --shared-prefix-len 150 --gen-len 10 --num-prompts 1536
"""


@click.command("policy", epilog=POLICY_EXAMPLE)
@click.option("--model", required=True, help="A preset (opt-30b, mixtral-8x7b, ...), alias or model folder.")
@click.option("--gpu-memory", type=SIZE, help="GPU budget, e.g. 16GiB (default: the profile's GPU memory).")
@click.option("--cpu-memory", type=SIZE,
              help=f"CPU budget, e.g. 100GiB (default: {core.PINNED_SHARE:.0%} of the profile's RAM, the pinned share).")
@click.option("--disk-memory", type=SIZE, default="0", show_default=True, help="Disk budget, e.g. 500GiB.")
@click.option("--prompt-len", type=click.IntRange(min=1), default=512, show_default=True,
              help="Prompt length in tokens.")
@click.option("--gen-len", type=click.IntRange(min=1), default=32, show_default=True,
              help="New tokens per prompt.")
@click.option("--num-prompts", type=click.IntRange(min=1), help="Number of prompts (bounds the block size).")
@click.option("--shared-prefix-len", type=click.IntRange(min=0), default=0, show_default=True,
              help="Leading prompt tokens every prompt shares (system prompt, few-shot examples; part of "
                   "--prompt-len): computed once per GPU batch.")
@click.option("--dtype", default="auto", show_default=True, help="Compute dtype: auto, float16, bfloat16, float32.")
@click.option("--compress-weights", is_flag=True, help="Store weights 4-bit (group-wise).")
@click.option("--compress-cache", is_flag=True, help="Store the KV cache 4-bit (group-wise).")
@click.option("--allow-compression", is_flag=True,
              help="Let the search choose 4-bit weights and/or cache (outputs then differ slightly).")
@click.option("--profile", "profile_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A hardware profile JSON (as written by `llmops profile --json`).")
@click.option("--hardware", type=click.Choice(["local", "h200"]),
              help="local: measure this machine (cached); h200: the built-in H200 reference. "
                   "Default: local with a GPU, h200 without.")
@click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True,
              help="GPUs of this host (LLM(devices=...)): --gpu-memory holds on each, the CPU budget is shared "
                   "(each GPU plans within 1/N of it); explains the data- or pipeline-parallel split.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def policy_cmd(model: str, gpu_memory: int | None, cpu_memory: int | None, disk_memory: int, prompt_len: int,
               gen_len: int, num_prompts: int | None, shared_prefix_len: int, dtype: str, compress_weights: bool, compress_cache: bool,
               allow_compression: bool, profile_file: Path | None, hardware: str | None, gpus: int,
               as_json: bool) -> None:
    """Choose and explain the offloading policy for MODEL under memory budgets (on --gpus GPUs)."""
    try:
        config = core.model_config(model)
        torch_dtype = core.resolve_dtype(dtype, config)
        profile, profile_desc = _pick_profile(profile_file, hardware)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise click.UsageError(str(exc)) from None
    budgets = core.Budgets(
        gpu_bytes=gpu_memory if gpu_memory is not None else profile.gpu_memory_bytes,
        cpu_bytes=(cpu_memory if cpu_memory is not None else core.default_cpu_budget(profile.cpu_memory_bytes)) // gpus,
        disk_bytes=disk_memory,
    )
    if shared_prefix_len >= prompt_len:
        raise click.BadParameter(f"{shared_prefix_len} must be below --prompt-len {prompt_len} (every prompt keeps "
                                 "a token of its own)", param_hint="--shared-prefix-len")
    workload = core.Workload(prompt_len=prompt_len, gen_len=gen_len, num_prompts=num_prompts,
                             shared_prefix_len=shared_prefix_len)
    try:
        result = core.search(config, workload, budgets, profile,
                             bytes_per_element=core.dtype_bytes(torch_dtype),
                             compress_weights=compress_weights or (None if allow_compression else False),
                             compress_cache=compress_cache or (None if allow_compression else False),
                             model_name=model)
    except core.NoFeasiblePolicy as exc:
        click.echo(f"error: {exc}\n{_no_fit_hint(model, budgets, allow_compression or compress_weights)}", err=True)
        raise SystemExit(2) from None
    split = core.device_split(config, result.policy, gpus, core.dtype_bytes(torch_dtype),
                              result.predicted_tokens_per_s) if gpus > 1 else None
    if as_json:
        data = result.to_dict()
        data["profile"] = profile_desc
        data["dtype"] = str(torch_dtype).removeprefix("torch.")
        if split is not None:
            data["devices"] = split
        click.echo(json.dumps(data, sort_keys=True))
    else:
        click.echo(f"Hardware profile: {profile_desc}")
        click.echo(result.explain())
        if split is not None:
            click.echo(core.explain_split(split))


PROFILE_EXAMPLE = """
\b
Example:
  llmops profile              # measure once (under a minute), then print the cached profile
  llmops profile --refresh --json > h200.json
  llmops policy --model opt-30b --gpu-memory 16GiB --profile h200.json
"""


@click.command("profile", epilog=PROFILE_EXAMPLE)
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
              help="The compute device (the gpu tier).")
@click.option("--refresh", is_flag=True, help="Measure again even when a cached profile exists.")
@click.option("--disk-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Measure the disk under this folder (default: the temp folder).")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON (loadable with --profile).")
def profile_cmd(device: str, refresh: bool, disk_dir: Path | None, as_json: bool) -> None:
    """Measure (or read the cached) hardware profile of this machine: bandwidths, compute, capacities."""
    if device == "auto":
        device = "cuda" if core.cuda_available() else "cpu"
    if device == "cuda" and not core.cuda_available():
        raise click.UsageError("--device cuda: no CUDA GPU is available")
    kwargs = {"disk_dir": disk_dir} if disk_dir else {}
    profile = core.load_or_measure(device, refresh=refresh, **kwargs)
    if as_json:
        click.echo(json.dumps(profile.to_dict(), indent=2, sort_keys=True))
        return
    click.echo(f"Hardware profile of {profile.hostname} ({profile.source}), cached at "
               f"{core.device_profile_path(device)}")
    rows = [
        ("device", f"{profile.device_name} [{profile.device_type}]"),
        ("host -> device", f"{profile.h2d_gib_s:.2f} GiB/s"),
        ("device -> host", f"{profile.d2h_gib_s:.2f} GiB/s"),
        ("disk read / write", f"{profile.disk_read_gib_s:.2f} / {profile.disk_write_gib_s:.2f} GiB/s"),
        ("device matmul", f"{profile.gpu_tflops_bf16:.2f} TFLOP/s"),
        ("device memory", f"{profile.gpu_mem_gib_s:.1f} GiB/s"),
        ("host matmul (fp32)", f"{profile.cpu_gflops:.1f} GFLOP/s"),
        ("host attention (GEMV)", f"{profile.cpu_mem_gib_s:.1f} GiB/s"),
        ("layer launch overhead", f"{profile.layer_overhead_ms:.3f} ms"),
        ("memory gpu / cpu / disk free", f"{core.format_size(profile.gpu_memory_bytes)} / "
                                         f"{core.format_size(profile.cpu_memory_bytes)} / "
                                         f"{core.format_size(profile.disk_free_bytes)}"),
    ]
    for name, value in rows:
        click.echo(f"  {name:<30} {value}")
