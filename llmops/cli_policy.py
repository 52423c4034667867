"""`llmops policy` (explain the plan a run would use) and `llmops profile` (measure this machine).

Registered in `llmops.cli` with `from llmops.cli_policy import policy_cmd, profile_cmd`. `llmops policy` plans
through the engine's one planning path (`llmops.core.plan_model` -> `engine.plan_model`), with the defaults a
run uses (budgets from the hardware profile, this machine's profile unless `--hardware` or `--profile` says
otherwise) and the plan cache a run fills, so it prints the plan `llmops run` and its `--dry-run` use for a
job of that shape. A budget no policy fits exits with status 2 and the reason on stderr.
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


def _no_fit_hint(model: str, budgets: Any | None, compressing: bool, local: bool) -> str:
    """What to try when no policy fits: a cpu budget the weights fit in, a disk tier, 4-bit weights, the
    reference machine."""
    size = next((r.get("bytes") for r in core.engine_models() if r.get("name") == model and r.get("bytes")), None)
    tips = []
    if size and budgets is not None:
        gib = 2 ** 30
        need = max(32, -(-int(size * 1.25 / 0.9) // (32 * gib)) * 32)   # weights + cache, 90% usable
        if need * gib > budgets.cpu_bytes:
            tips.append(f"--cpu-memory {need}GiB (the weights are {core.format_size(size)})")
    if budgets is not None and not budgets.disk_bytes:
        tips.append("--disk-memory 200GiB (weights streamed from disk)")
    if not compressing:
        tips.append("--allow-compression (4-bit weights, ~1/4 of the size)")
    if local and core.default_device() == "cpu":
        tips.append("--hardware h200 (plan for the built-in H200 machine: this one has no GPU)")
    return "hint: try " + "; or ".join(tips) if tips else "hint: raise the budgets or shorten --prompt-len/--gen-len"


POLICY_EXAMPLE = """
\b
Example:
  llmops policy --model opt-30b --gpu-memory 16GiB --cpu-memory 100GiB \\
      --disk-memory 500GiB --prompt-len 512 --gen-len 32 --hardware h200
  llmops policy --model mixtral-8x7b --gpu-memory 24GiB --cpu-memory 128GiB --json
  llmops policy --model llama-3-70b --gpu-memory 16GiB --allow-compression --gpus 2
  llmops policy --model llama-3-70b --gpu-memory 16GiB --cpu-memory 100GiB --compress-weights \
      --compress-cache --prompt-len 200 --shared-prefix-len 150 --gen-len 10 --num-prompts 1536
"""


@click.command("policy", epilog=POLICY_EXAMPLE)
@click.option("--model", required=True, help="A preset (opt-30b, mixtral-8x7b, ...), alias or model folder.")
@click.option("--gpu-memory", type=SIZE, help="GPU budget, e.g. 16GiB (default: the profile's GPU memory).")
@click.option("--cpu-memory", type=SIZE,
              help=f"CPU budget, e.g. 100GiB (default: {core.DEFAULT_CPU_SHARE:.0%} of the profile's available RAM, "
                   "the pinned share).")
@click.option("--disk-memory", type=SIZE, help="Disk budget, e.g. 500GiB (default: none).")
@click.option("--prompt-len", type=click.IntRange(min=1), default=512, show_default=True,
              help="Mean prompt length in tokens.")
@click.option("--max-prompt-len", type=click.IntRange(min=1),
              help="Longest prompt in tokens: memory is planned for it (default: --prompt-len).")
@click.option("--gen-len", type=click.IntRange(min=1), default=32, show_default=True,
              help="New tokens per prompt.")
@click.option("--num-prompts", type=click.IntRange(min=1), help="Number of prompts (bounds the block size).")
@click.option("--shared-prefix-len", type=click.IntRange(min=0), default=0, show_default=True,
              help="Leading prompt tokens every prompt shares (system prompt, few-shot examples; part of "
                   "--prompt-len): computed once per GPU batch.")
@click.option("--dtype", default="auto", show_default=True,
              help="Compute dtype: auto (bfloat16 on a GPU, as a run), float16, bfloat16, float32.")
@click.option("--compress-weights", is_flag=True, help="Store weights 4-bit (group-wise).")
@click.option("--compress-cache", is_flag=True, help="Store the KV cache 4-bit (group-wise).")
@click.option("--allow-compression", is_flag=True,
              help="Let the search choose 4-bit weights and/or cache (outputs then differ slightly).")
@click.option("--trials", type=click.IntRange(min=0), default=0, show_default=True,
              help="The engine setting `trials`: say whether a run would refine this plan by trials (a plan "
                   "a run already refined comes from the plan cache either way).")
@click.option("--profile", "profile_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A hardware profile JSON (as written by `llmops profile --json`).")
@click.option("--hardware", type=click.Choice(["local", *core.REFERENCE_MACHINES]), default="local", show_default=True,
              help="local: the profile a run on this machine plans with (measured once on a GPU, cached); "
                   "h200: the built-in H200 reference.")
@click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True,
              help="GPUs of this host (LLM(devices=...)): --gpu-memory holds on each, the host's budgets are "
                   "shared (each GPU plans within 1/N of them); explains the data- or pipeline-parallel split.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def policy_cmd(model: str, gpu_memory: int | None, cpu_memory: int | None, disk_memory: int | None, prompt_len: int,
               max_prompt_len: int | None, gen_len: int, num_prompts: int | None, shared_prefix_len: int, dtype: str,
               compress_weights: bool, compress_cache: bool, allow_compression: bool, trials: int,
               profile_file: Path | None, hardware: str, gpus: int, as_json: bool) -> None:
    """Explain the plan a run of MODEL would use under memory budgets (on --gpus GPUs)."""
    if shared_prefix_len >= prompt_len:
        raise click.BadParameter(f"{shared_prefix_len} must be below --prompt-len {prompt_len} (every prompt keeps "
                                 "a token of its own)", param_hint="--shared-prefix-len")
    if max_prompt_len is not None and max_prompt_len < prompt_len:
        raise click.BadParameter(f"{max_prompt_len} is below the mean --prompt-len {prompt_len}",
                                 param_hint="--max-prompt-len")
    budgets = None
    try:
        profile, profile_desc = core.hardware_profile(profile_file if profile_file is not None else hardware)
        budgets = core.plan_budgets(profile, devices=gpus, gpu_memory=gpu_memory, cpu_memory=cpu_memory,
                                    disk_memory=disk_memory)
        plan = core.plan_model(model, prompt_len=prompt_len, gen_len=gen_len, num_prompts=num_prompts,
                               max_prompt_len=max_prompt_len, shared_prefix_len=shared_prefix_len, profile=profile,
                               gpu_memory=gpu_memory, cpu_memory=cpu_memory, disk_memory=disk_memory, dtype=dtype,
                               compress_weights=compress_weights or (None if allow_compression else False),
                               compress_cache=compress_cache or (None if allow_compression else False),
                               trials=trials, devices=gpus)
    except core.NoFeasiblePolicy as exc:
        hint = _no_fit_hint(model, budgets, allow_compression or compress_weights, profile_file is None and
                            hardware == "local")
        click.echo(f"error: {exc}\n{hint}", err=True)
        raise SystemExit(2) from None
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise click.UsageError(str(exc)) from None
    if as_json:
        click.echo(json.dumps({**plan.to_dict(), "profile": profile_desc}, sort_keys=True, default=str))
    else:
        click.echo(f"Hardware profile: {profile_desc}")
        click.echo(plan.explain())


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
        device = core.default_device()
    if device == "cuda" and core.default_device() != "cuda":
        raise click.UsageError("--device cuda: no CUDA GPU is available")
    profile, path = core.measure_profile(device, refresh=refresh, disk_dir=disk_dir)
    if as_json:
        click.echo(json.dumps(profile.to_dict(), indent=2, sort_keys=True))
        return
    click.echo(f"Hardware profile of {profile.hostname} ({profile.source}), cached at {path}")
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
        ("device 4-bit decode attention", f"{profile.gpu_q4_attention_kv_ns:.3f} ns per kv head + "
                                          f"{profile.gpu_q4_attention_q_ns:.3f} ns per query head, a position"
         if profile.gpu_q4_attention_s(1, 1) is not None else "not measured (no fused kernel here)"),
        ("memory gpu / cpu / disk free", f"{core.format_size(profile.gpu_memory_bytes)} / "
                                         f"{core.format_size(profile.cpu_memory_bytes)} / "
                                         f"{core.format_size(profile.disk_free_bytes)}"),
    ]
    for name, value in rows:
        click.echo(f"  {name:<30} {value}")
