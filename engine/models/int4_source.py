"""Pre-quantized AWQ / GPTQ int4 Hugging Face checkpoints: a weight source that keeps their packed form.

`Int4Config` (engine.models.int4_config, parsed into `ModelConfig.quantization_config`) refuses, naming the
field, what our 4-bit group-wise format cannot hold. Tensor-level problems are found from the headers (and
GPTQ's small g_idx) when the source is built, naming the tensor: packed shapes that do not fit group_size,
act-order (desc_act) g_idx that is not input // group_size (accepted when it still is), and a decoder
matmul weight packed (or left in float) against what `Int4Config.packs` says (modules_to_not_convert).

`Int4SafetensorsSource` reads a linear layer's `X.weight` from `X.qweight` / `X.qzeros` / `X.scales`
(/ `X.g_idx`) wherever the checkpoint holds those instead (the rest, e.g. embeddings, norms, the head and
modules_to_not_convert, load as usual). `get_stored` is what the runtime's weight homes read: the packed
decoder weights as QTensors in our format with the checkpoint's own groups (fused along dim 0 or stacked
as the WeightSpec says; codes as in the file, nothing re-quantized, no dense copy made), the rest dense.
`get_qtensors` gives every weight the file holds packed as QTensors; `get` dequantizes them (the
WeightSource contract: dense tensors in the source's dtype, e.g. for a float reference).
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine.models.base import LayerSpec, WeightSpec
from engine.models.int4_config import Int4Config
from engine.models.safetensors_source import SafetensorsSource
from engine.models.weights import fuse
from engine.quant.group import dequantize
from engine.quant.int4_checkpoint import UnsupportedInt4, awq_qtensor, check_g_idx, gptq_qtensor
from engine.quant.qtensor import QTensor


class Int4SafetensorsSource(SafetensorsSource):
    """A SafetensorsSource whose linear weights may be AWQ/GPTQ packed triples (module docstring)."""

    def __init__(self, folder: Path, specs: list[LayerSpec], dtype: torch.dtype, quant: Int4Config,
                 ignored_prefixes: tuple[str, ...] = ()) -> None:
        self.quant = quant
        super().__init__(folder, specs, dtype, ignored_prefixes)
        self._check_packed(specs)

    def _check_packed(self, specs: list[LayerSpec]) -> None:
        """ValueError naming the first decoder matmul weight the file holds in a form Int4Config.packs
        does not predict (the memory model counts what it predicts)."""
        for spec in specs:
            for ws in spec.weights.values():
                if not ws.quantizable:
                    continue
                packed = [self._packed(s) for s in ws.sources]
                want = self.quant.packs(ws.sources)
                if any(p != want for p in packed):
                    name = ws.sources[packed.index(not want)]
                    held = "packed (qweight/qzeros/scales)" if not want else "in float"
                    raise ValueError(f"{self.folder}: tensor {name!r} is {held}, but config.json quantization_config "
                                     f"(modules_to_not_convert={list(self.quant.skip_modules)}) says it is "
                                     f"{'packed' if want else 'left in float'}")

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

    def get_stored(self, spec: LayerSpec) -> dict[str, torch.Tensor | QTensor]:
        """The layer's weights as the runtime holds them: the decoder matmul weights the checkpoint packs
        as QTensors of its groups (`Int4Config.packs`, checked at load), every other weight dense."""
        out: dict[str, torch.Tensor | QTensor] = {}
        for local, ws in spec.weights.items():
            if ws.quantizable and self.quant.packs(ws.sources):
                out[local] = _fuse_q(ws, [self._qtensor(s) for s in ws.sources])
            else:
                out[local] = fuse(ws, [self._read(s) for s in ws.sources])
        return out


def _fuse_q(ws: WeightSpec, parts: list[QTensor]) -> QTensor:
    """`fuse` for QTensors: codes, mins and scales concatenated along dim 0 or stacked (leading dims only)."""
    if len(parts) == 1:
        return parts[0]
    data, mn, scale = ([getattr(p, f) for p in parts] for f in ("data", "mn", "scale"))
    return QTensor(fuse(ws, data), fuse(ws, mn), fuse(ws, scale), torch.Size(ws.shape), parts[0].config,
                   parts[0].dtype)

