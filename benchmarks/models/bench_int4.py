"""Random-weight AWQ int4 checkpoints written tensor by tensor, never materialising a float model.

A checkpoint is first declared as data: `mixtral_tensors` lists every tensor of a MixtralForCausalLM in
the Hugging Face hub layout (name, shape, dtype, how to fill it); `plan_shards` cuts that list into shards
of about `shard_bytes`; `write_checkpoint` then draws each shard's tensors on `device` (CUDA when there is
one: generation is then bounded by the disk), copies them to the host and saves the shard with safetensors,
one shard in host memory at a time (twice its size while safetensors serialises it), plus
model.safetensors.index.json.

AWQ GEMM layout (engine.quant.int4_checkpoint, as AutoAWQ / transformers write it) of a linear W [out, in]
with groups of `g` inputs: `qweight` int32 [in, out / 8], `qzeros` int32 [in / g, out / 8] (8 nibbles per
int32), `scales` float16 [in / g, out]; W[o, i] = (q - z) * s. Every nibble is drawn independently, so the
AWQ nibble order (which output sits in which nibble) does not change the distribution and needs no packing:
- codes q: uniform in 0..15 (each byte of qweight uniform), mean 7.5, variance 255 / 12;
- zero points z: uniform in 6..9, mean 7.5, variance 5 / 4;
- scales s: uniform in (1 -+ SCALE_SPREAD) x c, with c chosen so that std(W) = `std`:
  E[s^2] = c^2 (1 + SCALE_SPREAD^2 / 3), E[(q - z)^2] = 255 / 12 + 5 / 4 (q and z independent, equal means).
Dense tensors (embeddings, lm_head, the router `block_sparse_moe.gate`: AWQ's `modules_to_not_convert`)
are N(0, std^2) in bfloat16, norms ones. Draws come from one generator seeded with `seed`, in tensor
order; CPU and CUDA generators give different values for the same seed.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ZERO_LO, ZERO_HI = 6, 9             # zero points drawn uniformly from ZERO_LO..ZERO_HI
SCALE_SPREAD = 0.1                  # scales uniform in (1 -+ SCALE_SPREAD) x c
CODE_VAR = 255 / 12                 # variance of a code uniform in 0..15
ZERO_VAR = ((ZERO_HI - ZERO_LO + 1) ** 2 - 1) / 12
SHARD_BYTES = 4 * 10 ** 9
DTYPES = {"int32": torch.int32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TensorPlan:
    """One checkpoint tensor to draw: `fill` is "codes" (qweight), "zeros" (qzeros), "scales", "normal" or
    "ones"."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    fill: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def awq_tensors(module: str, out_f: int, in_f: int, group: int) -> list[TensorPlan]:
    """The AWQ GEMM triple of the linear `module` (W [out_f, in_f], groups of `group` inputs)."""
    if in_f % group or out_f % 8:
        raise ValueError(f"{module}: a weight [{out_f}, {in_f}] needs in % {group} == 0 and out % 8 == 0 for AWQ")
    groups = in_f // group
    return [TensorPlan(f"{module}.qweight", (in_f, out_f // 8), "int32", "codes"),
            TensorPlan(f"{module}.qzeros", (groups, out_f // 8), "int32", "zeros"),
            TensorPlan(f"{module}.scales", (groups, out_f), "float16", "scales")]


def mixtral_tensors(c: dict[str, Any], group: int) -> list[TensorPlan]:
    """Every tensor of a MixtralForCausalLM with HF config fields `c`, attention and experts in AWQ int4."""
    h, i, v, e = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_local_experts"]
    q_out = c["num_attention_heads"] * c["head_dim"]
    kv_out = c["num_key_value_heads"] * c["head_dim"]
    out = [TensorPlan("model.embed_tokens.weight", (v, h), "bfloat16", "normal")]
    for j in range(c["num_hidden_layers"]):
        p = f"model.layers.{j}."
        out.append(TensorPlan(f"{p}input_layernorm.weight", (h,), "bfloat16", "ones"))
        for name, o, n in (("q_proj", q_out, h), ("k_proj", kv_out, h), ("v_proj", kv_out, h), ("o_proj", h, q_out)):
            out += awq_tensors(f"{p}self_attn.{name}", o, n, group)
        out.append(TensorPlan(f"{p}post_attention_layernorm.weight", (h,), "bfloat16", "ones"))
        out.append(TensorPlan(f"{p}block_sparse_moe.gate.weight", (e, h), "bfloat16", "normal"))  # router [E, h]
        for k in range(e):
            x = f"{p}block_sparse_moe.experts.{k}."
            out += awq_tensors(f"{x}w1", i, h, group) + awq_tensors(f"{x}w2", h, i, group) \
                + awq_tensors(f"{x}w3", i, h, group)
    out.append(TensorPlan("model.norm.weight", (h,), "bfloat16", "ones"))
    if not c["tie_word_embeddings"]:
        out.append(TensorPlan("lm_head.weight", (v, h), "bfloat16", "normal"))
    return out


def logical_params(tensors: list[TensorPlan]) -> int:
    """Parameters of the float model the tensors stand for (a packed weight counts in * out)."""
    return sum(math.prod(t.shape) * (8 if t.fill == "codes" else 1) for t in tensors
               if t.fill in ("codes", "normal", "ones"))


def plan_shards(tensors: list[TensorPlan], shard_bytes: int) -> list[list[TensorPlan]]:
    """Consecutive runs of `tensors` of at most `shard_bytes` each (a larger tensor gets a shard alone)."""
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def draw(t: TensorPlan, std: float, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """The random contents of `t` (module docstring) on `device`."""
    if t.fill == "codes":
        *lead, cols = t.shape
        raw = torch.randint(0, 256, (*lead, cols * 4), dtype=torch.uint8, generator=gen, device=device)
        return raw.view(torch.int32)                                                    # [in, out / 8]
    if t.fill == "zeros":
        z = torch.randint(ZERO_LO, ZERO_HI + 1, (*t.shape, 8), dtype=torch.int64, generator=gen, device=device)
        shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=device)
        return (z << shifts).sum(-1).to(torch.int32)                                    # [groups, out / 8], wraps
    if t.fill == "scales":
        c = std / math.sqrt((1 + SCALE_SPREAD ** 2 / 3) * (CODE_VAR + ZERO_VAR))
        s = torch.empty(t.shape, dtype=torch.float32, device=device)
        return s.uniform_((1 - SCALE_SPREAD) * c, (1 + SCALE_SPREAD) * c, generator=gen).half()  # [groups, out]
    if t.fill == "normal":
        return torch.empty(t.shape, dtype=DTYPES[t.dtype], device=device).normal_(0.0, std, generator=gen)
    if t.fill == "ones":
        return torch.ones(t.shape, dtype=DTYPES[t.dtype], device=device)
    raise ValueError(f"{t.name}: unknown fill {t.fill!r}")


def write_checkpoint(folder: Path, tensors: list[TensorPlan], *, seed: int, std: float, device: torch.device,
                     shard_bytes: int = SHARD_BYTES) -> dict[str, Any]:
    """Draw `tensors` shard by shard into `folder` (model-0000i-of-0000n.safetensors + index); returns
    {shards, bytes, draw_s (drawing and the copy to the host), save_s (safetensors writes)}."""
    shards = plan_shards(tensors, shard_bytes)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    draw_s = save_s = 0.0
    for n, shard in enumerate(shards, 1):
        start = time.perf_counter()
        data = {t.name: draw(t, std, gen, device).cpu() for t in shard}
        mid = time.perf_counter()
        fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(data, str(folder / fname), metadata={"format": "pt"})
        del data
        draw_s, save_s = draw_s + mid - start, save_s + time.perf_counter() - mid
        weight_map.update({t.name: fname for t in shard})
    total = sum(t.nbytes for t in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {"shards": len(shards), "bytes": total, "draw_s": round(draw_s, 2), "save_s": round(save_s, 2)}
