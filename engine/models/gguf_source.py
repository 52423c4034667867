"""Weights read straight from a GGUF file's quantized blocks, dequantized per layer on `get`.

The model cache keeps no dequantized copy of a GGUF (an fp32 copy of a 98 MB Q4_1 file is 517 MB): the
conversion (engine.models.gguf_convert) writes only config.json, the tokenizer files and a tensor index
(`gguf_tensors.json`: each tensor's Hugging Face name, GGML type, shape, absolute byte range and the head
count its rows are permuted by), so loading never re-parses the GGUF header (whose tokenizer arrays take
seconds to read). `get` memory-maps the GGUF, dequantizes the layer's tensors with `gguf.quants.dequantize`
(numpy, float32), undoes llama.cpp's q/k row permutation and casts to the source's dtype: the values equal
what the old fp32 conversion stored, bit for bit. Dequantizing all of SmolLM2-135M's Q4_1 blocks takes
~0.7 s on the 2-core development machine (once per executor build), against reading a 517 MB copy.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.models.base import LayerSpec
from engine.models.weights import expected_source_shapes, fuse, layer_nbytes

INDEX = "gguf_tensors.json"


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: rows (head, pair, half) in GGUF -> (head, half, pair) in HF."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_tensor(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """uint8 bytes of one GGUF tensor -> an owned float32 tensor of `shape` (HF order: outermost dim first),
    through `gguf.quants.dequantize`."""
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
        self._map: np.ndarray | None = None
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

    def _bytes(self, t: dict[str, Any]) -> np.ndarray:
        with self._lock:
            if self._map is None:
                self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return np.asarray(self._map[t["offset"]:t["offset"] + t["n_bytes"]])

    def _read(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        w = dequantize_tensor(self._bytes(t), t["type"], tuple(t["shape"]))
        if t.get("unpermute"):
            w = unpermute(w, int(t["unpermute"]))
        return w.to(self.dtype).contiguous()

    def get(self, spec: LayerSpec) -> dict[str, torch.Tensor]:
        return {local: fuse(ws, [self._read(s) for s in ws.sources]) for local, ws in spec.weights.items()}

    def nbytes(self, spec: LayerSpec) -> int:
        return layer_nbytes(spec, self.dtype)
