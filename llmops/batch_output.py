"""The output file of `llmops batch`: staged beside the target as lines finish, published in input order.

`StagedOutput(target)` checks the target before any work: it must be a regular file or absent (a link, a
folder or a device is never replaced), and its folder is created and must take a new file: the staging
file (`<target>.llmops-partial-<pid>-<random>.jsonl`) is created right away, so an unwritable path fails
before a single line is generated. `add(line, obj)` appends one output line to the staging file as soon
as it is known (flushed, so a crash keeps every answer so far); `publish()` writes the lines in input order
to a temporary name beside the target, syncs it and renames it into place, then removes the staging file.
A run that fails keeps the staging file (its path is in the error) and leaves the target as it was.
"""
from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any


def json_line(obj: dict[str, Any]) -> str:
    """One output line: compact JSON, UTF-8 kept, but U+2028 / U+2029 escaped so that no reader that splits on
    Unicode line breaks cuts a line in two."""
    return json.dumps(obj, ensure_ascii=False).replace("\u2028", "\\u2028").replace("\u2029", "\\u2029") + "\n"


class OutputError(ValueError):
    """The output path cannot be written (named in the message)."""


def check_target(path: Path) -> None:
    """OutputError unless `path` is absent or a regular file (not a link)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OutputError(f"--output {path}: cannot inspect it: {exc.strerror}") from None
    if stat.S_ISLNK(mode) or not stat.S_ISREG(mode):
        raise OutputError(f"--output {path}: not a regular file (a link, folder or device is never replaced)")


class StagedOutput:
    """Owner of one run's staging file for `target` (see module docstring)."""

    def __init__(self, target: Path) -> None:
        self.target = target
        check_target(target)
        tag = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.staging = target.with_name(f"{target.name}.llmops-partial-{tag}.jsonl")
        self._tmp = target.with_name(f"{target.name}.llmops-tmp-{tag}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.staging, "xb")   # noqa: SIM115 (held open until publish)
        except OSError as exc:
            raise OutputError(f"--output {target}: cannot write in {target.parent}: "
                              f"{exc.strerror or exc}") from None
        self._spans: dict[int, tuple[int, int]] = {}   # line number -> (offset, length) in the staging file
        self._end = 0

    def add(self, line: int, obj: dict[str, Any]) -> None:
        """Append the output line of input line `line`."""
        data = json_line(obj).encode("utf-8")
        self._file.write(data)
        self._file.flush()
        self._spans[line] = (self._end, len(data))
        self._end += len(data)

    def publish(self) -> None:
        """Write the staged lines in input order to the target (atomically) and remove the staging file."""
        self._file.close()
        try:
            with open(self.staging, "rb") as src, open(self._tmp, "wb") as dst:
                for line in sorted(self._spans):
                    offset, length = self._spans[line]
                    src.seek(offset)
                    dst.write(src.read(length))
                dst.flush()
                os.fsync(dst.fileno())
            check_target(self.target)
            os.replace(self._tmp, self.target)
        except OSError as exc:
            self._tmp.unlink(missing_ok=True)
            raise OutputError(f"--output {self.target}: cannot publish it: {exc.strerror or exc}; the answers are "
                              f"in {self.staging}") from None
        self.staging.unlink(missing_ok=True)

    def discard(self) -> None:
        """Remove the staging file (nothing was generated worth keeping)."""
        self._file.close()
        self.staging.unlink(missing_ok=True)

    def keep(self) -> str:
        """Close the staging file and keep it (a failed run); returns its path for the error message."""
        self._file.close()
        return str(self.staging)
