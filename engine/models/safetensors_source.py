"""Weights read lazily from a Hugging Face folder's memory-mapped safetensors files (single or sharded).

Headers are parsed up front (no tensor data read) so that missing, unexpected and mis-shaped tensors and
truncated files are reported before any compute; tensor data is read per layer on `get`.
Never unpickles anything.
"""
from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.base import LayerSpec
from engine.models.weights import expected_source_shapes, fuse, layer_nbytes

# Tensors some checkpoints carry that no layer needs (RoPE buffers saved by old transformers versions).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) from a safetensors file's header; ValueError naming a bad file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt or truncated safetensors file {path}: {e}") from None
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = (info["dtype"], tuple(info["shape"]))
        end = max(end, info["data_offsets"][1])
    if 8 + n + end > size:
        raise ValueError(
            f"corrupt or truncated safetensors file {path}: data ends at byte {8 + n + end}, file has {size}"
        )
    return out


def _some(names: list[str], k: int = 20) -> str:
    more = f" (+{len(names) - k} more)" if len(names) > k else ""
    return f"{names[:k]}{more}"


def shard_files(folder: Path) -> list[Path]:
    """The folder's safetensors files (from model.safetensors.index.json when present)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"corrupt safetensors index {index}: {e}") from None
        files = sorted({folder / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) that do not exist: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder} (pickled .bin checkpoints are not loaded)")
    return files


class SafetensorsSource:
    """A `WeightSource` over a folder's safetensors files; owns the open (memory-mapped) file handles."""

    def __init__(self, folder: Path, specs: list[LayerSpec], dtype: torch.dtype,
                 ignored_prefixes: tuple[str, ...] = ()) -> None:
        """`ignored_prefixes`: tensor names starting so are not reported as unexpected (a family's unused
        modules, e.g. DeepSeek-V3's multi-token-prediction layers)."""
        self.folder = Path(folder)
        self.dtype = dtype
        self.ignored_prefixes = tuple(ignored_prefixes) + tuple(p[len("model."):] for p in ignored_prefixes
                                                                 if p.startswith("model."))
        self.files = shard_files(self.folder)
        self._where: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        for f in self.files:
            for name, (_, shape) in read_header(f).items():
                self._where[name] = f
                self._shape[name] = shape
        self._handles: dict[Path, object] = {}
        self._lock = threading.Lock()
        self._resolved = self._check(specs)

    def _resolve(self, name: str) -> str | None:
        if name in self._where:
            return name
        if name.startswith("model.") and name[len("model."):] in self._where:
            return name[len("model."):]
        return None

    def _locate(self, name: str) -> tuple[list[str], tuple[int, ...]] | None:
        """The file tensor(s) behind source tensor `name` and its shape (None when absent). One tensor here;
        a pre-quantized source (engine.models.int4_source) maps a weight to its packed parts."""
        real = self._resolve(name)
        return None if real is None else ([real], self._shape[real])

    def _check(self, specs: list[LayerSpec]) -> dict[str, list[str]]:
        """Map every source name to the file's tensor name(s); raise ValueError listing every problem."""
        resolved: dict[str, list[str]] = {}
        missing: list[str] = []
        mismatched: list[str] = []
        for spec in specs:
            for local, ws in spec.weights.items():
                found = [self._locate(s) for s in ws.sources]
                missing += [s for s, r in zip(ws.sources, found) if r is None]
                if any(r is None for r in found):
                    continue
                resolved.update((s, r[0]) for s, r in zip(ws.sources, found))
                shapes = [r[1] for r in found]
                problem = expected_source_shapes(ws, shapes)
                if problem:
                    got = ", ".join(f"{r[0][0]} {list(sh)}" for r, sh in zip(found, shapes))
                    mismatched.append(f"{spec.name}/{local} {list(ws.shape)} from {got}: {problem}")
        used = {n for names in resolved.values() for n in names}
        unexpected = sorted(
            n for n in self._where
            if n not in used and not n.endswith(IGNORED_SUFFIXES) and n != "lm_head.weight"  # tied copies
            and not n.startswith(self.ignored_prefixes)
        )
        problems = []
        if missing:
            problems.append(f"missing tensors: {_some(missing)}")
        if mismatched:
            problems.append("shape mismatches: " + "; ".join(mismatched[:20]))
        if unexpected:
            problems.append(f"unexpected tensors: {_some(unexpected)}")
        if problems:
            raise ValueError(f"checkpoint {self.folder} does not match its config.json: " + " | ".join(problems))
        return resolved

    def _handle(self, path: Path):
        with self._lock:
            h = self._handles.get(path)
            if h is None:
                try:
                    h = safe_open(str(path), framework="pt", device="cpu")
                except Exception as e:  # safetensors raises its own error type
                    raise ValueError(f"corrupt safetensors file {path}: {e}") from None
                self._handles[path] = h
            return h

    def _raw(self, real: str) -> torch.Tensor:
        """File tensor `real` as stored (its own dtype)."""
        path = self._where[real]
        try:
            return self._handle(path).get_tensor(real)
        except Exception as e:
            raise ValueError(f"cannot read tensor {real!r} from {path}: {e}") from None

    def _read(self, name: str) -> torch.Tensor:
        return self._raw(self._resolved[name][0]).to(self.dtype)

    def get(self, spec: LayerSpec) -> dict[str, torch.Tensor]:
        return {local: fuse(ws, [self._read(s) for s in ws.sources]) for local, ws in spec.weights.items()}

    def nbytes(self, spec: LayerSpec) -> int:
        return layer_nbytes(spec, self.dtype)
