"""Peer systems for `throughput.py`, each optional: FlexGen 0.1.8 (OPT) and HF Accelerate (any preset
transformers builds), both on dummy weights.

Each runner takes the preset name, the token-id prompts, gen_len and the memory caps, and returns
{"ok", "total_s", "generated_tokens", "policy"...} or {"ok": False, "skipped": why} when its package (or a
GPU) is absent. FlexGen is driven through `flexgen.flex_opt.OptLM` with token ids and its "_DUMMY_" weights
(its `run_flexgen` loads a hub tokenizer); Accelerate streams layers from CPU memory (`device_map` under
`max_memory`), on weights filled as engine.models.dummy_source fills ours
(`dummy_hf_model`: seconds, not transformers' minutes of random init), timed per step (`timed_generate`) so a
short run projects to the workload's gen length (`short_run_fields`).
"""
from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import Timer, peak_gib, reset_peak

from engine.models.dummy_source import fill_dummy_

_HF_NAMES = {"opt-6.7b": "facebook/opt-6.7b", "opt-30b": "facebook/opt-30b", "opt-175b": "facebook/opt-175b"}


def _absent(package: str) -> str | None:
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed (pip install it, or carry its wheel in .whl/)"
    if not torch.cuda.is_available():
        return f"{package} needs a CUDA device"
    return None


def run_flexgen(model: str, prompts: list[list[int]], gen_len: int, policy: dict[str, Any],
                offload_dir: str) -> dict[str, Any]:
    """FlexGen's OptLM on dummy weights; `policy`: gpu_batch_size, num_gpu_batches, percent (6 numbers),
    compress_weight, compress_cache, cpu_cache_compute. Rows beyond one block are cut to the block size."""
    why = _absent("flexgen") or (None if model in _HF_NAMES else f"flexgen runs OPT presets only, not {model}")
    if why:
        return {"ok": False, "skipped": why}
    import numpy as np  # optional peer: only with flexgen installed
    from flexgen.compression import CompressionConfig  # optional peer
    from flexgen.flex_opt import OptLM, Policy, get_opt_config  # optional peer
    from flexgen.pytorch_backend import TorchDevice, TorchDisk, TorchMixedDevice  # optional peer
    from flexgen.utils import ExecutionEnv  # optional peer

    gpu, cpu, disk = TorchDevice("cuda:0"), TorchDevice("cpu"), TorchDisk(offload_dir)
    env = ExecutionEnv(gpu=gpu, cpu=cpu, disk=disk, mixed=TorchMixedDevice([gpu, cpu, disk]))
    p = Policy(policy["gpu_batch_size"], policy["num_gpu_batches"], *policy["percent"], overlap=True,
               sep_layer=True, pin_weight=True, cpu_cache_compute=policy.get("cpu_cache_compute", False),
               attn_sparsity=1.0, compress_weight=policy.get("compress_weight", False),
               comp_weight_config=CompressionConfig(num_bits=4, group_size=64, group_dim=0, symmetric=False),
               compress_cache=policy.get("compress_cache", False),
               comp_cache_config=CompressionConfig(num_bits=4, group_size=64, group_dim=2, symmetric=False))
    n = p.gpu_batch_size * p.num_gpu_batches
    ids = np.array([row[:len(prompts[0])] for row in (prompts * (1 + n // len(prompts)))[:n]], dtype=np.int64)
    lm = OptLM(get_opt_config(_HF_NAMES[model]), env, "_DUMMY_", p)
    try:
        lm.generate(ids, max_new_tokens=1)                                       # warm-up, as FlexGen does
        reset_peak()
        t0 = time.perf_counter()
        lm.generate(ids, max_new_tokens=gen_len)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    finally:
        env.close_copy_threads()
    return {"ok": True, "total_s": total, "generated_tokens": n * gen_len, "num_prompts": n, "policy": policy,
            **peak_gib()}


class StepClock:
    """A logits processor that only reads the clock: `generate` calls it once per new token, right after that
    step's forward, so the gaps between `marks` (from `start`, set when made) are the prefill, then each decode
    step. `sync` (torch.cuda.synchronize on CUDA) runs first, so a mark waits for the step's kernels."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.start = time.perf_counter()
        self.marks: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.sync()
        self.marks.append(time.perf_counter())
        return scores


def hf_model_config(hf_config: dict[str, Any]) -> Any:
    """The transformers config of a preset's HF dict (its `architectures` names the model type)."""
    import transformers  # optional peer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = {cls: name for name, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}[hf_config["architectures"][0]]
    return transformers.AutoConfig.for_model(model_type,
                                             **{k: v for k, v in hf_config.items() if k != "architectures"})


def dummy_hf_model(hf_config: dict[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    """The preset's transformers causal LM on the CPU in `dtype`, built without transformers' random init (which
    costs minutes at 47B parameters) and filled by `engine.models.dummy_source.fill_dummy_` (our dummy weights'
    values). Buffers are the ones the modules compute
    at construction (rotary inv_freq), so they are exact; tied weights (OPT's head) are tied, then filled
    once, in place."""
    import transformers  # optional peer
    from transformers.initialization import no_init_weights

    with torch.device("cpu"), no_init_weights():
        lm = transformers.AutoModelForCausalLM.from_config(hf_model_config(hf_config), dtype=dtype)
    lm.tie_weights()                                     # no_init_weights skips init_weights, which also ties
    with torch.no_grad():
        for name, param in lm.named_parameters():
            fill_dummy_(name, param.data)
    return lm.eval()


def timed_generate(lm: Any, ids: torch.Tensor, gen_len: int) -> dict[str, Any]:
    """One greedy `generate` of exactly gen_len new tokens, timed per step by a `StepClock`: total_s (the
    call's wall), prefill_s (to the first token), decode_s (first to last token) and step_s (the prefill,
    then each decode step). The caller warms up first."""
    from transformers import LogitsProcessorList  # optional peer

    clock = StepClock(torch.cuda.synchronize if ids.device.type == "cuda" else lambda: None)
    lm.generate(ids, max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False,
                logits_processor=LogitsProcessorList([clock]))
    clock.sync()
    total = time.perf_counter() - clock.start
    marks = [clock.start, *clock.marks]
    return {"total_s": total, "prefill_s": marks[1] - marks[0], "decode_s": marks[-1] - marks[1],
            "step_s": [[round(b - a, 4) for a, b in zip(marks, marks[1:])]]}


def short_run_fields(res: dict[str, Any], batch: int, gen_len: int, workload_gen_len: int) -> dict[str, Any]:
    """What a peer's short run (`batch` rows x gen_len new tokens) says at the workload's gen length:
    decode_step_s = decode_s / (gen_len - 1) and projected_tokens_per_s_at_workload_gen = batch * G /
    (prefill_s + (G - 1) * decode_step_s) with G = workload_gen_len (a projection, not a measurement; None
    when the run failed or decoded no step), and a note when gen_len is not the workload's."""
    out: dict[str, Any] = {"gen_len": gen_len, "workload_gen_len": workload_gen_len}
    if gen_len != workload_gen_len:
        out["peer_gen_len_note"] = (f"ran {batch} rows x {gen_len} new tokens, not the workload's {workload_gen_len}: "
                                    "tokens_per_s is this short run's; projected_tokens_per_s_at_workload_gen "
                                    "extends it from prefill_s and decode_step_s")
    step = res["decode_s"] / (gen_len - 1) if res.get("ok") and gen_len > 1 else None
    out["projected_tokens_per_s_at_workload_gen"] = None if step is None else \
        batch * workload_gen_len / (res["prefill_s"] + (workload_gen_len - 1) * step)
    return out


def run_accelerate(model: str, prompts: list[list[int]], gen_len: int, gpu_memory: int, batch: int,
                   hf_config: dict[str, Any], say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """transformers + accelerate with dummy fp16 weights (`dummy_hf_model`) placed by `infer_auto_device_map`
    under `max_memory` (the GPU capped at 0.8 x gpu_memory, the rest streamed from CPU memory); one batch of
    `batch` prompts after a 1-row, 1-token warm-up. Adds load_s (building the model), place_s (device map and
    dispatch) and `timed_generate`'s fields; `say` gets a line as each phase starts (a run cut short still tells
    how far it got)."""
    why = _absent("accelerate")
    if why:
        return {"ok": False, "skipped": why}
    from accelerate import dispatch_model, infer_auto_device_map  # optional peer

    say(f"accelerate: building {model} (dummy fp16 weights)")
    with Timer() as load:
        lm = dummy_hf_model(hf_config, torch.float16)
    say(f"accelerate: built in {load.seconds:.1f} s; placing under {gpu_memory * 0.8 / 2**30:.1f} GiB of GPU")
    with Timer() as place:
        device_map = infer_auto_device_map(lm, max_memory={0: int(gpu_memory * 0.8), "cpu": "1000GiB"},
                                           no_split_module_classes=["OPTDecoderLayer", "LlamaDecoderLayer",
                                                                    "MixtralDecoderLayer"])
        lm = dispatch_model(lm, device_map=device_map)
    if hasattr(lm, "_optimize_model_for_decode"):
        # transformers 5 switches Mixtral's experts to `batched_mm` for decoding, which copies expert weights
        # per (token, expert) and runs out of memory under the cap: keep the prefill kernel
        lm._optimize_model_for_decode = contextlib.nullcontext
    ids = torch.tensor([row[:len(prompts[0])] for row in (prompts * (1 + batch // len(prompts)))[:batch]],
                       device="cuda:0")
    say(f"accelerate: placed in {place.seconds:.1f} s; warm-up (1 row, 1 token)")
    lm.generate(ids[:1], max_new_tokens=1, do_sample=False)                   # warm-up: CUDA and kernel init
    reset_peak()
    say(f"accelerate: {batch} rows x {gen_len} new tokens")
    timed = timed_generate(lm, ids, gen_len)
    return {"ok": True, **timed, "generated_tokens": batch * gen_len, "num_prompts": batch,
            "load_s": load.seconds, "place_s": place.seconds,
            "policy": {"batch": batch, "device_map_gpu_modules": sum(1 for d in device_map.values() if d == 0)},
            **peak_gib()}
