"""The disk tier: the engine's own memory-mapped files.

Weights: one file per layer under `<disk_dir>/<key>/` (key = model fingerprint + dtype + compression), written
once and reused across runs. A file is written to a temporary name, fsynced and renamed into place; then a
JSON marker (layout, file size, sha256 of sampled ranges) is written the same way. A file whose marker is
missing, whose size differs or whose sampled checksum differs is rebuilt, never used.
Scratch (KV cache, activations on disk): anonymous-per-run memory-mapped files deleted by `close`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from engine.quant.config import QuantConfig
from engine.quant.qtensor import QTensor
from engine.storage.tiers import Stored

_ALIGN = 4096
_SAMPLE = 1 << 20
_FORMAT = 2


def _sampled_digest(path: Path, size: int) -> str:
    """sha256 over the first and last MiB and 16 evenly spaced 64 KiB windows of the file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        offsets = [0, max(0, size - _SAMPLE)] + [size * i // 17 for i in range(1, 17)]
        for i, off in enumerate(offsets):
            f.seek(off)
            h.update(f.read(_SAMPLE if i < 2 else 1 << 16))
    return h.hexdigest()


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _parts(name: str, value: Stored) -> list[tuple[str, torch.Tensor]]:
    if isinstance(value, QTensor):
        return [(f"{name}.data", value.data), (f"{name}.mn", value.mn), (f"{name}.scale", value.scale)]
    return [(name, value)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WeightFiles:
    """Verified, reusable per-layer weight files under `root`."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.rebuilt: list[str] = []

    def paths(self, name: str) -> tuple[Path, Path]:
        return self.root / f"{name}.bin", self.root / f"{name}.json"

    def load(self, name: str, build: Callable[[], dict[str, Stored]]) -> dict[str, Stored]:
        """The tensors of file `name`, memory-mapped; built with `build()` and written first if the file is
        missing, truncated or corrupt. Returned tensors are read-only views of the file (copy-on-write map)."""
        marker = self._valid_marker(name)
        if marker is None:
            self.rebuilt.append(name)
            marker = self._write(name, build())
        return self._map(name, marker)

    def _valid_marker(self, name: str) -> dict | None:
        data_path, marker_path = self.paths(name)
        try:
            marker = json.loads(marker_path.read_text())
            size = data_path.stat().st_size
        except (OSError, ValueError):
            return None
        if marker.get("format") != _FORMAT or marker.get("size") != size:
            return None
        if marker.get("digest") != _sampled_digest(data_path, size):
            return None
        return marker

    def _write(self, name: str, tensors: dict[str, Stored]) -> dict:
        data_path, marker_path = self.paths(name)
        entries, offset = [], 0
        tmp = data_path.with_name(f".{data_path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with open(tmp, "wb") as f:
            for tname, value in tensors.items():
                for pname, part in _parts(tname, value):
                    part = part.detach().contiguous().cpu()
                    raw = part.view(torch.uint8).reshape(-1).numpy() if part.numel() else np.zeros(0, np.uint8)
                    f.seek(offset)
                    f.write(raw.tobytes())
                    entries.append({"name": pname, "offset": offset, "dtype": _dtype_name(part.dtype),
                                    "shape": list(part.shape)})
                    offset += -(-raw.size // _ALIGN) * _ALIGN
                if isinstance(value, QTensor):
                    entries.append({"name": tname, "qshape": list(value.shape), "qdtype": _dtype_name(value.dtype),
                                    "group_size": value.config.group_size, "bits": value.config.bits,
                                    "rotate": value.config.rotate})
            f.truncate(max(offset, 1))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, data_path)
        size = data_path.stat().st_size
        marker = {"format": _FORMAT, "size": size, "digest": _sampled_digest(data_path, size), "entries": entries}
        _atomic_write_bytes(marker_path, json.dumps(marker).encode())
        return marker

    def _map(self, name: str, marker: dict) -> dict[str, Stored]:
        data_path, _ = self.paths(name)
        mm = torch.from_numpy(np.memmap(data_path, dtype=np.uint8, mode="c", shape=(marker["size"],)))
        parts: dict[str, torch.Tensor] = {}
        out: dict[str, Stored] = {}
        for e in marker["entries"]:
            if "qshape" in e:
                continue
            dtype = getattr(torch, e["dtype"])
            numel = int(np.prod(e["shape"])) if e["shape"] else 1
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            parts[e["name"]] = mm[e["offset"]:e["offset"] + nbytes].view(dtype).view(e["shape"])
        for e in marker["entries"]:
            if "qshape" in e:
                n = e["name"]
                out[n] = QTensor(parts.pop(f"{n}.data"), parts.pop(f"{n}.mn"), parts.pop(f"{n}.scale"),
                                 torch.Size(e["qshape"]), QuantConfig(bits=e["bits"], group_size=e["group_size"],
                                                                      rotate=e.get("rotate", False)),
                                 getattr(torch, e["qdtype"]))
        out.update(parts)
        return out


class ScratchFiles:
    """Per-run memory-mapped scratch tensors (disk-tier KV cache and activations), deleted by `close`."""

    def __init__(self, disk_dir: Path):
        Path(disk_dir).mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="scratch-", dir=disk_dir))
        self._count = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor of `shape`/`dtype` backed by a new file (writes go to the page cache)."""
        numel = int(np.prod(shape)) if shape else 1
        nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
        self._count += 1
        arr = np.memmap(self.dir / f"t{self._count:06d}.bin", dtype=np.uint8, mode="w+", shape=(nbytes,))
        return torch.from_numpy(arr)[:numel * torch.empty((), dtype=dtype).element_size()].view(dtype).view(shape)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
