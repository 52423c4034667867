"""The one record shape every harness writes, where records go, and atomic JSON / JSONL writing.

A record is one JSON object on one line of `benchmarks/records/<machine>/<benchmark>.jsonl` (`record_path`):
the machine is `machine.machine_slug()` ("h100", "h200", "cpu-2core"), the benchmark the harness's name. Every
record carries `run_id` (one invocation; $LLMOPS_RUN_ID shares one across the invocations of a suite run),
`system`, `benchmark`, `workload`, `model`, `gpu_memory_gib`, `tokens_per_s` and `rows_per_h` (null where the
benchmark measures something else), `peak_device_gib` (torch's peak; null on the CPU), `device`, `machine`,
`commit`, `command` and `timestamp`, then the harness's own fields. A run appends; nothing is numbered by run,
since a file's history is git's. The records folder is $LLMOPS_RECORDS_DIR when set, else `$OUT/records` when
$OUT is set (a GPU host's output folder), else benchmarks/records/.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import secrets
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common.machine import GIB, ROOT, device_name, git_commit, machine, machine_slug

RECORDS_DIR = ROOT / "benchmarks" / "records"
COMMON_FIELDS = ("run_id", "system", "benchmark", "workload", "model", "gpu_memory_gib", "tokens_per_s",
                 "rows_per_h", "peak_device_gib", "device", "machine", "commit", "command", "timestamp")


def new_run_id() -> str:
    """A run id shared by the records of one invocation: $LLMOPS_RUN_ID when set (a suite run exports it once so
    all its invocations share it), else UTC time + 6 random hex digits."""
    if os.environ.get("LLMOPS_RUN_ID"):
        return os.environ["LLMOPS_RUN_ID"]
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(3)


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed (sys.argv joined, shell-quoted where needed), prefixed with `python`."""
    return shlex.join(["python", *(sys.argv if argv is None else argv)])


def records_dir() -> Path:
    """$LLMOPS_RECORDS_DIR, else $OUT/records, else benchmarks/records/."""
    if os.environ.get("LLMOPS_RECORDS_DIR"):
        return Path(os.environ["LLMOPS_RECORDS_DIR"])
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "records"
    return RECORDS_DIR


def record_path(benchmark: str, machine_name: str | None = None) -> Path:
    """`<records_dir>/<machine>/<benchmark>.jsonl`: where a harness appends by default."""
    return records_dir() / (machine_name or machine_slug()) / f"{benchmark}.jsonl"


def size_gib(value: int | str | None) -> float | None:
    """A size (bytes or "16GiB") in GiB; None stays None."""
    if value is None:
        return None
    from engine.util.sizes import parse_size

    return round(parse_size(value) / GIB, 3)


def base_record(run_id: str, system: str, *, commit: dict[str, Any] | None = None,
                command: str | None = None) -> dict[str, Any]:
    """The fields every record carries: run_id, system, device, machine, commit, command, timestamp."""
    return {"run_id": run_id, "system": system, "device": device_name(), "machine": machine(),
            "commit": commit if commit is not None else git_commit(), "command": command or command_line(),
            "timestamp": utc_now()}


def new_record(benchmark: str, workload: str, model: str | None, *, system: str = "llmops",
               gpu_memory: int | str | None = None, device: str | None = None, commit: str | None = None,
               run_id: str | None = None) -> dict[str, Any]:
    """A record with every common field (`COMMON_FIELDS`): the metrics (tokens_per_s, rows_per_h,
    peak_device_gib) start null for the harness to fill. `device` overrides the detected one (a run pinned to
    the CPU on a GPU machine); `commit` is an explicit value (`--commit`)."""
    rec = base_record(run_id or new_run_id(), system, commit=git_commit(commit))
    if device is not None:
        rec["device"] = device
    fields = {**rec, "benchmark": benchmark, "workload": workload, "model": model,
              "gpu_memory_gib": size_gib(gpu_memory), "tokens_per_s": None, "rows_per_h": None,
              "peak_device_gib": None}
    return {k: fields[k] for k in COMMON_FIELDS}


def add_record_args(ap: Any, *, out_help: str | None = None) -> None:
    """`--out` (the JSONL file records are appended to; default `record_path(benchmark)`) and `--commit` (for a
    tree copied without git)."""
    ap.add_argument("--out", type=Path, default=None,
                    help=out_help or "JSONL file to append the record to "
                                     "(default benchmarks/records/<machine>/<benchmark>.jsonl)")
    ap.add_argument("--commit", default=None, help="commit to record (default: $LLMOPS_COMMIT, then git)")


def _dumps(obj: Any, **kw: Any) -> str:
    return json.dumps(obj, default=str, allow_nan=False, **kw)


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one record as one line with a single O_APPEND write, then fsync: a reader never sees half a line
    unless the machine dies mid-write (`read_jsonl` skips such a tail)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (_dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def save_record(record: dict[str, Any], out: str | Path | None = None) -> Path:
    """Append `record` to `out`, default `record_path(record["benchmark"])`; says where on stderr and returns
    the path."""
    path = Path(out) if out is not None else record_path(record["benchmark"])
    append_jsonl(path, record)
    print(f"appended a record to {path}", file=sys.stderr)
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every complete record of a JSONL file ([] when absent); an unparsable line is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a file: every line of a `.jsonl` file, or a `.json` file's one object (a list of objects
    as they are). A missing file is a FileNotFoundError naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no records file {path}")
    if path.suffix == ".jsonl":
        return read_jsonl(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, list) else [data]


def rewrite_jsonl(path: str | Path, record: dict[str, Any], key: tuple[str, ...]) -> None:
    """Replace the record of `path` whose `key` fields equal `record`'s (appending when none does): the whole
    file is rewritten to a temporary name and renamed, so readers see the old or the new file, never a mix.
    A harness that updates its record as a run progresses uses this instead of `save_record`."""
    lines, found = [], False
    for old in read_jsonl(path):
        if all(old.get(k) == record.get(k) for k in key):
            old, found = record, True
        lines.append(_dumps(old))
    if not found:
        lines.append(_dumps(record))
    write_text_atomic(path, "".join(line + "\n" for line in lines))


def write_json_atomic(path: str | Path, obj: Any, *, indent: int | None = 2) -> None:
    """Write JSON to a temporary file beside `path`, fsync, rename into place."""
    write_text_atomic(path, _dumps(obj, indent=indent) + "\n")


def write_text_atomic(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def failure_fields(err: BaseException) -> dict[str, Any]:
    """A failed configuration's record fields: ok False, the error named, the traceback's tail."""
    import traceback

    return {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-2000:]}
