"""Atomic text and JSON files: what the engine caches on disk (hardware profile, CPU dtype, plans) is written whole
or not at all, so a reader never sees a partial file."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` (UTF-8) to `path`: a temporary file in the same folder, fsync, rename into place, mode
    0644 (the folder is created when missing; a failed write leaves `path` as it was and no temporary file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)                 # as an ordinary new file (mkstemp makes it 0600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, payload: Any) -> None:
    """Write `payload` as JSON (indented, keys sorted) to `path` atomically, as `write_text_atomic`."""
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True, default=str))
