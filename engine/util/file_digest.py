"""Content digests of weight files: every byte hashed, once per file version.

`file_digest(path, cache_dir)` is sha256 over the file's content, read in `CHUNK` pieces hashed on several
threads (hashlib releases the GIL) and combined in order: the digest of the chunk digests, with the file
size. Any changed byte of any tensor changes it, unlike a digest of the size and a few MiB (a GGUF's first
MiB is mostly metadata, so tensors swapped between layers, or two fine-tunes sharing the metadata and the
last tensors, would look alike). Reading a large model once costs seconds to a minute, so the result is
kept in `<cache_dir>/weight_digests.json`, keyed by the file's resolved path and its size, mtime_ns,
ctime_ns and inode: a file rewritten in place (even with its old mtime put back: the ctime still moves) or
replaced by another (new inode) is hashed again, an unchanged one never. The JSON is replaced atomically (temporary name, rename); an unreadable one is
ignored and rebuilt; losing a concurrent update only costs a second hashing.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHUNK = 64 << 20        # bytes hashed per task
DIGESTS = "weight_digests.json"
_LOCK = threading.Lock()


def _chunk_digest(fd: int, offset: int, size: int) -> bytes:
    h = hashlib.sha256()
    done = 0
    while done < size:
        data = os.pread(fd, min(8 << 20, size - done), offset + done)
        if not data:
            raise OSError(f"file shrank while it was read (at byte {offset + done})")
        h.update(data)
        done += len(data)
    return h.digest()


def content_digest(path: Path) -> str:
    """sha256 (hex, 32 characters) over every byte of `path`, hashed in parallel chunks (see module
    docstring); no cache."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        offsets = range(0, size, CHUNK)
        workers = max(1, min(len(offsets), os.cpu_count() or 1, 8))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            parts = list(pool.map(lambda o: _chunk_digest(fd, o, min(CHUNK, size - o)), offsets))
    finally:
        os.close(fd)
    top = hashlib.sha256(f"file:{size}:{CHUNK}:".encode())
    for part in parts:
        top.update(part)
    return top.hexdigest()[:32]


def _stamp(path: Path) -> tuple[str, str]:
    st = path.stat()
    return str(path.resolve()), f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"


def _read(table: Path) -> dict[str, dict[str, str]]:
    try:
        data = json.loads(table.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def file_digest(path: Path, cache_dir: Path | None) -> str:
    """`content_digest(path)`, served from `<cache_dir>/weight_digests.json` while the file's (path, size,
    mtime_ns, ctime_ns, inode) are unchanged; computed and recorded otherwise. `cache_dir` None: no record."""
    path = Path(path)
    if cache_dir is None:
        return content_digest(path)
    key, stamp = _stamp(path)
    table = Path(cache_dir) / DIGESTS
    known = _read(table).get(key)
    if isinstance(known, dict) and known.get("stamp") == stamp and isinstance(known.get("digest"), str):
        return known["digest"]
    digest = content_digest(path)
    if _stamp(path)[1] != stamp:           # changed while it was read: do not record a digest of a mix
        return digest
    with _LOCK:
        data = _read(table)
        data[key] = {"stamp": stamp, "digest": digest}
        tmp = None
        try:
            table.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{DIGESTS}.", dir=table.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=0, sort_keys=True)
            os.replace(tmp, table)
        except OSError:   # a read-only cache folder: the digest is still right, only not remembered
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
    return digest
