"""Loading an AWQ int4 checkpoint never expands it: peak RSS while the executor places the weights stays near
the packed size, far below the model dequantized (as tests/engine/test_gguf_memory.py does for GGUF files).

A random AWQ GEMM `llama` checkpoint (6 layers of hidden 1024, intermediate 3072, groups of 128: 320 MiB
dense in fp32, ~45 MiB on disk) is loaded, in a fresh subprocess, into an executor without compress_weights
(the weights are 4-bit already and stay so): VmHWM (peak resident set, reset through /proc/self/clear_refs
after imports and warm-up) minus the RSS before must stay under the executor's weight homes + the file
(its memory-mapped pages count as resident once read) + 1.5 x the largest single tensor dense in fp32 (the
unpacking's temporaries of one tensor). The whole model dequantized would be more than twice that.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from helpers.paths import REPO

CFG = dict(num_hidden_layers=6, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
           num_key_value_heads=16, max_position_embeddings=512, rms_norm_eps=1e-5, vocab_size=1024)
GROUP = 128
_PINNED = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}     # see tests/engine/test_gguf_memory.py

_PROBE = r"""
import json, sys, torch
from pathlib import Path
from engine.models.loader import load_model
from engine.policy.policy import Policy
from engine.quant.group import quantize
from engine.quant.qtensor import QTensor
from engine.runtime.executor import Executor

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
path = Path(sys.argv[1])
quantize(torch.randn(64, 512))                      # warm up torch's allocator and kernels
m = load_model(path, dtype=torch.float32)
open("/proc/self/clear_refs", "w").write("5")      # reset VmHWM to the current RSS
before = status("VmRSS")
m = load_model(path, dtype=torch.float32)
ex = Executor(m, Policy(gpu_batch_size=1), device=torch.device("cpu"), dtype=torch.float32)
homes = [h for layer in ex.weights.homes for h in layer.values()]
kept = sum(h.nbytes for h in homes)
specs = m.family.layer_specs()
largest = max(ws.numel * 4 for s in specs for ws in s.weights.values())
print(json.dumps({"peak": status("VmHWM") - before, "kept": kept, "largest": largest,
                  "total": sum(m.weights.nbytes(s) for s in specs),
                  "packed": sum(isinstance(h.value, QTensor) for h in homes)}))
"""


def _write(path: Path) -> int:
    """The checkpoint (AWQ GEMM layout, random codes); returns its size in bytes."""
    g = torch.Generator().manual_seed(0)
    h, i, n, v = CFG["hidden_size"], CFG["intermediate_size"], CFG["num_hidden_layers"], CFG["vocab_size"]
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(v, h, generator=g).half() * 0.02,
                                  "model.norm.weight": torch.ones(h, dtype=torch.float16),
                                  "lm_head.weight": torch.randn(v, h, generator=g).half() * 0.02}

    def linear(name: str, out_f: int, in_f: int) -> None:
        t[f"{name}.qweight"] = torch.randint(-2 ** 31, 2 ** 31 - 1, (in_f, out_f // 8), dtype=torch.int32, generator=g)
        t[f"{name}.qzeros"] = torch.randint(-2 ** 31, 2 ** 31 - 1, (in_f // GROUP, out_f // 8), dtype=torch.int32,
                                            generator=g)
        t[f"{name}.scales"] = torch.rand(in_f // GROUP, out_f, generator=g).half() * 1e-3

    for j in range(n):
        p = f"model.layers.{j}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            linear(f"{p}.self_attn.{proj}", h, h)
        linear(f"{p}.mlp.gate_proj", i, h)
        linear(f"{p}.mlp.up_proj", i, h)
        linear(f"{p}.mlp.down_proj", h, i)
        t[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
    path.mkdir()
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float16", **CFG,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                "version": "gemm"}}))
    return (path / "model.safetensors").stat().st_size


def test_peak_rss_while_loading_stays_near_the_packed_size(tmp_path):
    file_bytes = _write(tmp_path / "awq")
    out = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "awq")], capture_output=True, text=True,
                         cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", **_PINNED}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    budget = r["kept"] + file_bytes + 1.5 * r["largest"]
    print(f"peak RSS while loading: {r['peak'] / 2**20:.1f} MiB; kept {r['kept'] / 2**20:.1f} MiB, file "
          f"{file_bytes / 2**20:.1f} MiB, largest tensor {r['largest'] / 2**20:.1f} MiB, budget "
          f"{budget / 2**20:.1f} MiB, dense model {r['total'] / 2**20:.1f} MiB")
    assert r["packed"] == 4 * CFG["num_hidden_layers"]               # qkv, o, gate_up, down: all 4-bit
    assert r["total"] > 2 * budget                                  # the probe can tell a dense model apart
    assert r["peak"] <= budget, r
