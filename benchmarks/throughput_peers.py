"""Peer systems for `throughput.py`, each optional: FlexGen 0.1.8 and HF Accelerate on dummy OPT weights.

Each runner takes the preset name, the token-id prompts, gen_len and the memory caps, and returns
{"ok", "total_s", "generated_tokens", "policy"...} or {"ok": False, "skipped": why} when its package (or a
GPU) is absent. FlexGen is driven through `flexgen.flex_opt.OptLM` with token ids and its "_DUMMY_" weights
(its `run_flexgen` loads a hub tokenizer); Accelerate streams layers from CPU memory (`device_map` under
`max_memory`), as ENVIRONMENT.md measured it.
"""
from __future__ import annotations

import contextlib
import importlib.util
import time
from typing import Any

import torch

from bench_common import peak_gib, reset_peak

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


def run_accelerate(model: str, prompts: list[list[int]], gen_len: int, gpu_memory: int, batch: int,
                   hf_config: dict[str, Any]) -> dict[str, Any]:
    """transformers + accelerate with random fp16 weights placed by `device_map="auto"` under `max_memory`
    (the GPU capped at gpu_memory, the rest streamed from CPU memory); one batch of `batch` prompts."""
    why = _absent("accelerate")
    if why:
        return {"ok": False, "skipped": why}
    import transformers  # optional peer
    from accelerate import dispatch_model, infer_auto_device_map  # optional peer

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = {cls: name for name, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}[hf_config["architectures"][0]]
    cfg = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in hf_config.items() if k != "architectures"})
    with torch.device("cpu"):
        lm = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float16)
    device_map = infer_auto_device_map(lm, max_memory={0: int(gpu_memory * 0.8), "cpu": "1000GiB"},
                                       no_split_module_classes=["OPTDecoderLayer", "LlamaDecoderLayer",
                                                                "MixtralDecoderLayer"])
    lm = dispatch_model(lm, device_map=device_map)
    if hasattr(lm, "_optimize_model_for_decode"):
        # transformers 5 switches Mixtral's experts to `batched_mm` for decoding, which copies expert weights
        # per (token, expert) and ran out of memory under the cap (ENVIRONMENT.md): keep the prefill kernel
        lm._optimize_model_for_decode = contextlib.nullcontext
    ids = torch.tensor([row[:len(prompts[0])] for row in (prompts * (1 + batch // len(prompts)))[:batch]],
                       device="cuda:0")
    lm.generate(ids, max_new_tokens=1, do_sample=False)
    reset_peak()
    t0 = time.perf_counter()
    lm.generate(ids, max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return {"ok": True, "total_s": total, "generated_tokens": batch * gen_len, "num_prompts": batch,
            "policy": {"batch": batch, "device_map_gpu_modules": sum(1 for d in device_map.values() if d == 0)},
            **peak_gib()}
