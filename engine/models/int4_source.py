"""Pre-quantized AWQ / GPTQ int4 Hugging Face checkpoints: their `quantization_config` and a weight source.

`Int4Config.from_hf` reads config.json's `quantization_config` and refuses, naming the field, what our 4-bit
group-wise format cannot hold: bits other than 4, AWQ versions other than GEMM or without zero points, GPTQ
checkpoint formats other than "gptq" / "gptq_v2". Tensor-level problems are found from the headers (and GPTQ's
small g_idx) when the source is built, naming the tensor: packed shapes that do not fit group_size, act-order
(desc_act) g_idx that is not input // group_size (accepted when it still is).

`Int4SafetensorsSource` reads a linear layer's `X.weight` from `X.qweight` / `X.qzeros` / `X.scales`
(/ `X.g_idx`) wherever the checkpoint holds those instead (the rest, e.g. embeddings, norms, the head and
modules_to_not_convert, load as usual): `get_qtensors` gives them as QTensors in our format with the
checkpoint's own groups (fused along dim 0 or stacked as the WeightSpec says; nothing re-quantized),
`get` their dequantization in the source's dtype, so every runtime path works unchanged. (The runtime's
weight homes still take dense tensors and, with compress_weights, re-quantize them into WEIGHT_QUANT's
groups of 32; taking `get_qtensors` there would keep the checkpoint's codes.)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.models.base import LayerSpec, WeightSpec
from engine.models.safetensors_source import SafetensorsSource
from engine.models.weights import fuse
from engine.quant.group import dequantize
from engine.quant.int4_checkpoint import UnsupportedInt4, awq_qtensor, check_g_idx, gptq_qtensor
from engine.quant.qtensor import QTensor

METHODS = ("awq", "gptq")
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}          # checkpoint_format -> the offset its zero points carry


@dataclass(frozen=True)
class Int4Config:
    """What loading an AWQ/GPTQ checkpoint needs from its quantization_config."""

    method: str                 # "awq" | "gptq"
    group_size: int             # -1 in the file (one group per input row) -> 0 here: the whole input dim
    zero_offset: int = 0        # GPTQ "gptq" format stores zero points minus one

    @staticmethod
    def from_hf(q: dict[str, Any]) -> "Int4Config":
        """Validate config.json's quantization_config; ValueError naming the unsupported field and value."""
        method = str(q.get("quant_method", "")).lower()
        where = f"config.json quantization_config (quant_method={method!r})"
        if method not in METHODS:
            raise ValueError(f"{where}: only {list(METHODS)} int4 checkpoints are loaded")
        bits = q.get("bits", q.get("w_bit"))
        if bits != 4:
            raise ValueError(f"{where}: bits={bits} is not supported (only 4)")
        group = int(q.get("group_size", q.get("q_group_size", 128)))
        if group != -1 and (group < 2 or group % 2):
            raise ValueError(f"{where}: group_size={group} is not supported (an even number >= 2, or -1)")
        if method == "awq":
            version = str(q.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"{where}: version={version!r} is not supported (only 'gemm'; its qweight layout)")
            if q.get("zero_point", True) is False:
                raise ValueError(f"{where}: zero_point=false is not supported (AWQ GEMM with zero points only)")
            return Int4Config(method, max(group, 0))
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        if fmt not in _GPTQ_FORMATS:
            raise ValueError(f"{where}: checkpoint_format={fmt!r} is not supported; supported: {list(_GPTQ_FORMATS)}")
        return Int4Config(method, max(group, 0), _GPTQ_FORMATS[fmt])


class Int4SafetensorsSource(SafetensorsSource):
    """A SafetensorsSource whose linear weights may be AWQ/GPTQ packed triples (module docstring)."""

    def __init__(self, folder: Path, specs: list[LayerSpec], dtype: torch.dtype, quant: Int4Config,
                 ignored_prefixes: tuple[str, ...] = ()) -> None:
        self.quant = quant
        super().__init__(folder, specs, dtype, ignored_prefixes)

    def _locate(self, name: str) -> tuple[list[str], tuple[int, ...]] | None:
        found = super()._locate(name)
        if found is not None or not name.endswith(".weight"):
            return found
        stem = name[: -len("weight")]
        parts = [self._resolve(stem + p) for p in ("qweight", "qzeros", "scales")]
        if any(p is None for p in parts):
            return None
        g_idx = self._resolve(stem + "g_idx")
        qweight = self._shape[parts[0]]
        out_f, in_f = (qweight[1] * 8, qweight[0]) if self.quant.method == "awq" else (qweight[1], qweight[0] * 8)
        groups = -(-in_f // (self.quant.group_size or in_f))
        for part, want in ((parts[1], (groups, out_f // 8)), (parts[2], (groups, out_f))):
            if tuple(self._shape[part]) != want:
                raise ValueError(f"{self.folder}: tensor {part!r} is {list(self._shape[part])}, expected {list(want)} "
                                 f"for a weight [{out_f}, {in_f}] in groups of {self.quant.group_size or in_f} "
                                 f"inputs ({self.quant.method} group_size in config.json)")
        if g_idx is not None:
            try:
                check_g_idx(self._raw(g_idx), in_f, self.quant.group_size or in_f)
            except UnsupportedInt4 as e:
                raise ValueError(f"{self.folder}: tensor {g_idx!r} ({self.quant.method}): {e}") from None
        return parts + ([g_idx] if g_idx else []), (out_f, in_f)

    def _packed(self, name: str) -> bool:
        return len(self._resolved[name]) > 1

    def _qtensor(self, name: str) -> QTensor:
        files = self._resolved[name]
        qweight, qzeros, scales = (self._raw(f) for f in files[:3])
        g_idx = self._raw(files[3]) if len(files) > 3 else None
        in_f = qweight.shape[0] if self.quant.method == "awq" else qweight.shape[0] * 8
        group = self.quant.group_size or in_f
        try:
            if self.quant.method == "awq":
                return awq_qtensor(qweight, qzeros, scales, group, self.dtype)
            return gptq_qtensor(qweight, qzeros, scales, g_idx, group, self.dtype, self.quant.zero_offset)
        except UnsupportedInt4 as e:
            raise ValueError(f"{self.folder}: tensor {files[0]!r} ({self.quant.method}): {e}") from None

    def _read(self, name: str) -> torch.Tensor:
        return dequantize(self._qtensor(name)) if self._packed(name) else super()._read(name)

    def get_qtensors(self, spec: LayerSpec) -> dict[str, QTensor]:
        """The layer's weights that the checkpoint holds packed, as QTensors (fused per WeightSpec; a weight
        whose sources are not all packed with one group size is left out: `get` has it dense)."""
        out: dict[str, QTensor] = {}
        for local, ws in spec.weights.items():
            if all(self._packed(s) for s in ws.sources):
                parts = [self._qtensor(s) for s in ws.sources]
                if len({p.config for p in parts}) == 1:
                    out[local] = _fuse_q(ws, parts)
        return out


def _fuse_q(ws: WeightSpec, parts: list[QTensor]) -> QTensor:
    """`fuse` for QTensors: codes, mins and scales concatenated along dim 0 or stacked (leading dims only)."""
    if len(parts) == 1:
        return parts[0]
    data, mn, scale = ([getattr(p, f) for p in parts] for f in ("data", "mn", "scale"))
    return QTensor(fuse(ws, data), fuse(ws, mn), fuse(ws, scale), torch.Size(ws.shape), parts[0].config,
                   parts[0].dtype)

