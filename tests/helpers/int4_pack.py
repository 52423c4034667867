"""AWQ / GPTQ int4 checkpoints written offline: decoder linears packed from a random float weight exactly as
AutoAWQ (`WQLinear_GEMM.from_linear`) and AutoGPTQ (`QuantLinear.pack`) lay them out, saved as safetensors with a
quantization_config, beside a float copy of the dequantized weights."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

GROUP = 32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantize_ref(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit of w [out, in] per (output, group of inputs): q [out, in] int, z / s [out, groups]."""
    out_f, in_f = w.shape
    g = w.view(out_f, in_f // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    s = ((hi - lo) / 15).clamp(min=1e-8).half()                                  # float16 as both tools store
    z = torch.round(-lo / s.float()).clamp(0, 15)
    q = torch.clamp(torch.round(g / s.float()[..., None]) + z[..., None], 0, 15).view(out_f, in_f)
    return q.int(), z.int(), s


def dequant_ref(q, z, s, group: int) -> torch.Tensor:
    """(q - z) * s, float32 [out, in]."""
    zz = z.repeat_interleave(group, dim=1).float()
    return (q.float() - zz) * s.float().repeat_interleave(group, dim=1)


def pack_cols(x: torch.Tensor, order) -> torch.Tensor:
    """[r, 8n] ints -> int32 [r, n]: nibble k of column c holds column 8c + order[k]."""
    out = torch.zeros(x.shape[0], x.shape[1] // 8, dtype=torch.int64)
    for c in range(out.shape[1]):
        for k in range(8):
            out[:, c] |= x[:, 8 * c + order[k]].long() << (4 * k)
    return out.to(torch.int32)                                                     # wraps like a uint32 view


def pack_awq(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, z, s = quantize_ref(w, group)
    packed = {"qweight": pack_cols(q.t(), AWQ_ORDER), "qzeros": pack_cols(z.t(), AWQ_ORDER),
              "scales": s.t().contiguous()}
    return packed, dequant_ref(q, z, s, group)


def pack_gptq(w: torch.Tensor, group: int, zero_offset: int = 1) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, z, s = quantize_ref(w, group)
    qt = q.t()                                                                     # [in, out]
    qweight = torch.zeros(qt.shape[0] // 8, qt.shape[1], dtype=torch.int64)
    for r in range(qweight.shape[0]):
        for k in range(8):
            qweight[r] |= qt[8 * r + k].long() << (4 * k)
    zeros = (z.t() - zero_offset) & 0xF                                           # "gptq" stores z - 1
    packed = {"qweight": qweight.to(torch.int32), "qzeros": pack_cols(zeros, list(range(8))),
              "scales": s.t().contiguous(), "g_idx": torch.arange(w.shape[1], dtype=torch.int32) // group}
    return packed, dequant_ref(q, z, s, group)


def write_int4(src: Path, dst: Path, method: str, qc: dict, group: int | None = GROUP,
               **kw) -> dict[str, torch.Tensor]:
    """Copy checkpoint `src` to `dst` with every decoder linear packed by `method` in groups of `group` inputs
    (None: one group per row); a float copy of the dequantized weights goes to `dst`.parent / (dst.name +
    "_float"). Returns name -> reference weight."""
    tensors = load_file(str(src / "model.safetensors"))
    packed, float_copy, ref = {}, dict(tensors), {}
    for name, w in tensors.items():
        module = name.rsplit(".", 2)
        if len(module) == 3 and module[1] in LINEARS and module[2] == "weight":
            parts, deq = (pack_awq if method == "awq" else pack_gptq)(w.float(), group or w.shape[1], **kw)
            packed.update({f"{name[:-len('weight')]}{k}": v for k, v in parts.items()})
            float_copy[name], ref[name] = deq, deq
        else:
            packed[name] = w
    for folder, data in ((dst, packed), (dst.parent / f"{dst.name}_float", float_copy)):
        folder.mkdir()
        save_file(data, str(folder / "model.safetensors"))
        d = json.loads((src / "config.json").read_text())
        if folder == dst:
            d["quantization_config"] = qc
        (folder / "config.json").write_text(json.dumps(d))
    return ref


AWQ_QC = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
GPTQ_QC = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False}
