"""Weights read straight from a GGUF file's quantized blocks, dequantized per layer on `get`.

The model cache keeps no dequantized copy of a GGUF (an fp32 copy of a 98 MB Q4_1 file is 517 MB): the
conversion (engine.models.gguf_convert) writes only config.json, the tokenizer files and a tensor index
(`gguf_tensors.json`: each tensor's Hugging Face name, GGML type, shape, absolute byte range, the head
count its rows are permuted by and the offset its values carry), so loading never re-parses the GGUF
header (whose tokenizer arrays take seconds to read). `get` memory-maps the GGUF, dequantizes the layer's
tensors one at a time (float32: Q4_0, Q4_1, Q5_0 and Q8_0 by torch ops, `engine.models.gguf_blocks`, other types
with `gguf.quants.dequantize`, numpy) straight into the layer's fused output tensors, undoes llama.cpp's q/k
row permutation and Gemma's `1 + w` norm offset and casts to the source's dtype; each tensor's file pages are then dropped from this process's mapping (MADV_DONTNEED:
clean file pages, re-read on the next touch), so resident memory while loading is the layer being built
plus what the caller keeps, never the file. Any GGML type `gguf.quants` dequantizes is accepted (F32, F16,
BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants and IQ types).
"""
from __future__ import annotations

import json
import mmap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.models.base import LayerSpec, WeightSpec
from engine.models.gguf_blocks import BLOCKS, dequantize_blocks
from engine.models.weights import expected_source_shapes, is_stacked, layer_nbytes

INDEX = "gguf_tensors.json"
_CHUNK_BYTES = 1 << 20          # float32 bytes dequantized at once


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: rows (head, pair, half) in GGUF -> (head, half, pair) in HF."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_tensor(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """uint8 bytes of one GGUF tensor -> an owned float32 tensor of `shape` (HF order: outermost dim first):
    Q4_0, Q4_1, Q5_0 and Q8_0 blocks by torch ops (`engine.models.gguf_blocks`, the same bits), any other type
    through `gguf.quants.dequantize`."""
    if ggml_type in BLOCKS:
        return dequantize_blocks(raw, ggml_type).view(shape)
    from gguf import GGMLQuantizationType  # gguf: only GGUF sources need it
    from gguf.quants import dequantize

    w = dequantize(raw, GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.array(w, dtype=np.float32).reshape(shape))


def read_index(folder: Path) -> dict[str, Any]:
    """The tensor index a conversion wrote (ValueError naming the file when it is unreadable)."""
    path = Path(folder) / INDEX
    try:
        data = json.loads(path.read_text())
        tensors = {t["hf"]: t for t in data["tensors"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"GGUF tensor index {path} is unreadable ({exc}); delete {folder} to convert again") from None
    return {**data, "tensors": tensors}


class GGUFSource:
    """A `WeightSource` over one GGUF file; owns its read-only memory map. Thread-safe."""

    def __init__(self, gguf_path: Path, index: dict[str, Any], specs: list[LayerSpec], dtype: torch.dtype) -> None:
        self.path = Path(gguf_path)
        self.dtype = dtype
        self._tensors: dict[str, dict[str, Any]] = index["tensors"]
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()
        self._check(specs)

    def _check(self, specs: list[LayerSpec]) -> None:
        size = self.path.stat().st_size
        problems: list[str] = []
        for spec in specs:
            for local, ws in spec.weights.items():
                missing = [s for s in ws.sources if s not in self._tensors]
                if missing:
                    problems.append(f"missing tensors {missing}")
                    continue
                shapes = [tuple(self._tensors[s]["shape"]) for s in ws.sources]
                bad = expected_source_shapes(ws, shapes)
                if bad:
                    problems.append(f"{spec.name}/{local} {list(ws.shape)} from {shapes}: {bad}")
        past = [n for n, t in self._tensors.items() if t["offset"] + t["n_bytes"] > size]
        if past:
            problems.append(f"tensors past the end of the file ({size} bytes): {past[:5]}")
        if problems:
            raise ValueError(f"GGUF {self.path} does not match its converted index: " + " | ".join(problems[:20]))

    def _mapped(self) -> mmap.mmap:
        with self._lock:
            if self._map is None:
                with open(self.path, "rb") as f:
                    self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            return self._map

    def _read_into(self, name: str, out: torch.Tensor) -> None:
        """Dequantize source tensor `name` into `out` (its HF shape, this source's dtype) a chunk of rows at
        a time (~_CHUNK_BYTES of float32; whole heads when its rows are permuted), so the temporaries of
        dequantization stay small whatever the tensor's size; its file pages are dropped afterwards."""
        t = self._tensors[name]
        mm = self._mapped()
        shape = tuple(t["shape"])
        rows = shape[0] if len(shape) > 1 else 1
        row_bytes, row_numel = t["n_bytes"] // rows, out.numel() // rows
        heads = int(t.get("unpermute") or 0)
        unit = rows // heads if heads else 1                       # rows per head when unpermuting
        step = max(unit, _CHUNK_BYTES // (4 * row_numel) // unit * unit)
        flat = out.view(rows, row_numel)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            raw = np.frombuffer(mm, dtype=np.uint8, count=(r1 - r0) * row_bytes, offset=t["offset"] + r0 * row_bytes)
            w = dequantize_tensor(raw, t["type"], (r1 - r0, row_numel))   # [r, cols] float32
            del raw
            if heads:
                w = unpermute(w, (r1 - r0) // unit)
            if t.get("offset_by"):
                w -= float(t["offset_by"])
            flat[r0:r1].copy_(w)
        start = t["offset"] - t["offset"] % mmap.PAGESIZE
        mm.madvise(mmap.MADV_DONTNEED, start, t["offset"] + t["n_bytes"] - start)

    def _fused(self, ws: WeightSpec) -> torch.Tensor:
        """`fuse` of the sources, each dequantized straight into its rows (or slot) of the output."""
        out = torch.empty(ws.shape, dtype=self.dtype)
        if len(ws.sources) == 1:
            self._read_into(ws.sources[0], out)
            return out
        stacked, row = is_stacked(ws), 0
        for j, name in enumerate(ws.sources):
            if stacked:
                self._read_into(name, out[j])
            else:
                n = int(self._tensors[name]["shape"][0])
                self._read_into(name, out[row:row + n])
                row += n
        return out

    def get(self, spec: LayerSpec) -> dict[str, torch.Tensor]:
        return {local: self._fused(ws) for local, ws in spec.weights.items()}

    def nbytes(self, spec: LayerSpec) -> int:
        return layer_nbytes(spec, self.dtype)
