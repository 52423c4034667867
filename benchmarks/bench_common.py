"""The suite's shared module (DESIGN.md section 6): paths, a timer, run ids, machine, device and commit capture,
atomic JSON / JSONL writing, and the one record shape and file naming every harness uses. Importing it puts the
repository root on `sys.path`.

    sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/ (already there for a script)
    from bench_common import Timer, add_record_args, new_record, results_path, save_record

    add_record_args(ap)                                          # --out, --commit
    args = ap.parse_args()
    record = new_record("cpu_generate", "sample-prompts", "smollm2-135m-instruct", commit=args.commit)
    with Timer() as t:
        ...
    record.update(seconds=t.seconds, tokens_per_s=...)
    save_record(args.out or results_path("cpu_generate", "sample-prompts"), record)

Records: run_id (one invocation, one device call), system, benchmark, workload, model, gpu_memory_gib,
tokens_per_s / rows_per_h, peak_device_gib, device, machine, commit, command, timestamp, then the harness's
own fields. Files: `<benchmark>_<workload>.json` (`.jsonl` for harnesses that append one record per run or
path), in benchmarks/results/ (the dev machine) or `results/<device>/` (e.g. `results/h200/`); never numbered by
run, since history is git's. JSONL harnesses (job_paths.py) use `base_record` + `append_jsonl` directly.

Torch is imported only by the functions that need it (device and peak memory), so a harness that has no GPU
work can use the rest without it. Commit capture works without a `.git` (the device machine gets a copy of
the working tree): an explicit value (`--commit`), then `$LLMOPS_COMMIT` ("<sha>" or "<sha>-dirty"), then
`git rev-parse HEAD` + dirtiness.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "benchmarks"
RESULTS_DIR = BENCH_DIR / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GIB = 1024 ** 3


# ---- timing
class Timer:
    """`with Timer() as t: ...` then `t.seconds`; `t.mark()` records the first time something happened
    (`t.first`, seconds since the start), later calls are ignored. `t.elapsed` reads the clock while running."""

    def __init__(self) -> None:
        self.start = 0.0
        self.end: float | None = None
        self.first: float | None = None

    def __enter__(self) -> "Timer":
        self.start = time.perf_counter()
        self.end = None
        self.first = None
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end = time.perf_counter()

    @classmethod
    def started(cls) -> "Timer":
        """A timer already running, for a span that is no one block of code: read `.elapsed` at its end."""
        return cls().__enter__()

    @property
    def elapsed(self) -> float:
        return (self.end if self.end is not None else time.perf_counter()) - self.start

    @property
    def seconds(self) -> float:
        return self.elapsed

    def mark(self) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.start


def median_ms(fn: Any, device: Any, repeat: int, warmup: int = 2) -> float:
    """Median milliseconds of fn() over `repeat` runs after `warmup` runs (which compile Triton kernels):
    CUDA events on the current stream for a CUDA `device` (each run synced at its end), perf_counter
    elsewhere."""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            with Timer() as t:
                fn()
            times.append(t.seconds * 1e3)
    return statistics.median(times)


# ---- ids, commands, timestamps
def new_run_id() -> str:
    """A run id shared by the records of one invocation: $LLMOPS_RUN_ID when set (one device call running
    several invocations, e.g. an A/B of two commits, exports it once so all its records share it), else UTC
    time + 6 random hex digits."""
    if os.environ.get("LLMOPS_RUN_ID"):
        return os.environ["LLMOPS_RUN_ID"]
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(3)


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed (sys.argv joined, shell-quoted where needed), prefixed with `python`."""
    return shlex.join(["python", *(sys.argv if argv is None else argv)])


# ---- commit
def git_commit(explicit: str | None = None, root: Path = ROOT) -> dict[str, Any]:
    """{"sha", "dirty", "source"}: `explicit` (e.g. --commit), else $LLMOPS_COMMIT, else git (HEAD + whether
    tracked files differ); sha None when none is known. A trailing "-dirty" in a given value sets dirty."""
    def parse(value: str, source: str) -> dict[str, Any]:
        value = value.strip()
        dirty = value.endswith(("-dirty", "+dirty"))
        return {"sha": value[:-6] if dirty else value, "dirty": dirty if dirty else None, "source": source}

    if explicit:
        return parse(explicit, "argument")
    if os.environ.get("LLMOPS_COMMIT"):     # before git: a copied tree (the lent GPU) may carry a stale .git
        return parse(os.environ["LLMOPS_COMMIT"], "env LLMOPS_COMMIT")
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if sha.returncode == 0 and sha.stdout.strip():
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=30)
            changed = [ln[3:] for ln in status.stdout.splitlines() if ln.strip()]
            return {"sha": sha.stdout.strip(), "dirty": bool(changed), "dirty_files": changed[:50],
                    "source": "git"}
    except (OSError, subprocess.SubprocessError):
        pass
    return {"sha": None, "dirty": None, "source": None}


# ---- machine and device
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def package_versions(names: Iterable[str]) -> dict[str, str | None]:
    """Installed versions (None when absent), read from metadata: nothing is imported."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def device_name() -> str:
    """The GPU's name (torch.cuda.get_device_name) or "cpu (<cpu model>, N cores)"."""
    if cuda_available():
        import torch

        return torch.cuda.get_device_name(0)
    return f"cpu ({_cpu_model()}, {os.cpu_count()} cores)"


def device_slug() -> str:
    """A file-name form of the device: "cpu" or e.g. "nvidia_h200"."""
    if not cuda_available():
        return "cpu"
    return "".join(c if c.isalnum() else "_" for c in device_name().lower()).strip("_")


def machine() -> dict[str, Any]:
    """Host and accelerator facts for a record."""
    info: dict[str, Any] = {"host": platform.node(), "platform": platform.platform(),
                            "python": platform.python_version(), "cpu": _cpu_model(), "cpus": os.cpu_count()}
    ram = _ram_bytes()
    if ram:
        info["ram_gib"] = round(ram / GIB, 1)
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info.update(gpu=props.name, gpu_count=torch.cuda.device_count(),
                        gpu_memory_gib=round(props.total_memory / GIB, 1), cuda=torch.version.cuda)
    except ImportError:
        pass
    return info


# ---- device memory
def reset_peak(devices: int = 1) -> None:
    """Reset torch's peak-memory counters on the first `devices` GPUs (no-op without one)."""
    if cuda_available():
        import torch

        for index in range(devices):
            torch.cuda.synchronize(index)
            torch.cuda.reset_peak_memory_stats(index)


def peak_gib(devices: int = 1) -> dict[str, Any]:
    """{"peak_device_gib": max allocated, "peak_reserved_gib": max reserved} since the last reset, the
    largest over the first `devices` GPUs (with several, also "peak_device_gib_per_gpu"); None on CPU."""
    if not cuda_available():
        return {"peak_device_gib": None, "peak_reserved_gib": None}
    import torch

    allocated, reserved = [], []
    for index in range(devices):
        torch.cuda.synchronize(index)
        allocated.append(round(torch.cuda.max_memory_allocated(index) / GIB, 3))
        reserved.append(round(torch.cuda.max_memory_reserved(index) / GIB, 3))
    out: dict[str, Any] = {"peak_device_gib": max(allocated), "peak_reserved_gib": max(reserved)}
    if devices > 1:
        out["peak_device_gib_per_gpu"] = allocated
    return out


def size_gib(value: int | str | None) -> float | None:
    """A size (bytes or "16GiB") in GiB; None stays None."""
    if value is None:
        return None
    from engine.util.sizes import parse_size

    return round(parse_size(value) / GIB, 3)


# ---- records and files
def base_record(run_id: str, system: str, *, commit: dict[str, Any] | None = None,
                command: str | None = None) -> dict[str, Any]:
    """The fields every record carries: run_id, system, device, machine, commit, command, timestamp."""
    return {"run_id": run_id, "system": system, "device": device_name(), "machine": machine(),
            "commit": commit if commit is not None else git_commit(), "command": command or command_line(),
            "timestamp": utc_now()}


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


def rewrite_jsonl(path: str | Path, record: dict[str, Any], key: tuple[str, ...]) -> None:
    """Replace the record of `path` whose `key` fields equal `record`'s (appending when none does): the whole
    file is rewritten to a temporary name and renamed, so readers see the old or the new file, never a mix."""
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


def rows_per_hour(rows: int, seconds: float | None) -> float | None:
    return round(rows * 3600.0 / seconds, 1) if seconds else None


# ---- the suite's harness helpers: one naming scheme, one record shape
def results_path(benchmark: str, workload: str, suffix: str = ".json", folder: str | Path | None = None) -> Path:
    """Where a harness writes by default: `<benchmark>_<workload><suffix>` in `folder`, else in $OUT when it is
    set (the device machine's output folder; the lead commits those under `results/<device>/`), else in
    benchmarks/results/. Runs are not numbered: history is git's."""
    if folder is None:
        folder = os.environ.get("OUT") or RESULTS_DIR
    return Path(folder) / f"{benchmark}_{workload_slug(workload)}{suffix}"


def workload_slug(text: str) -> str:
    """A workload name as it goes into a file name: lower case, runs of other characters than letters, digits,
    '.', '+' and '-' as one '-' ("OPT-6.7B split 1/32" -> "opt-6.7b-split-1-32")."""
    out, dash = [], False
    for c in text.lower():
        if c.isalnum() or c in ".+-":
            out.append(c)
            dash = False
        elif not dash:
            out.append("-")
            dash = True
    return "".join(out).strip("-")


def add_record_args(ap: Any, *, out_help: str = "result file (default results_path(benchmark, workload))") -> None:
    """`--out` (a file; None: the harness's `results_path`) and `--commit` (for a tree copied without git)."""
    ap.add_argument("--out", type=Path, default=None, help=out_help)
    ap.add_argument("--commit", default=None, help="commit to record (default: git, then $LLMOPS_COMMIT)")


def new_record(benchmark: str, workload: str, model: str | None, *, system: str = "llmops",
               gpu_memory: int | str | None = None, device: str | None = None, commit: str | None = None,
               run_id: str | None = None) -> dict[str, Any]:
    """A record with DESIGN.md section 6's common fields (run_id, system, benchmark, workload, model,
    gpu_memory_gib, device, machine, commit, command, timestamp) and the metric fields every harness fills or
    leaves null (tokens_per_s, rows_per_h, peak_device_gib). `device` overrides the detected one (a run pinned
    to the CPU on a GPU machine); `commit` is an explicit value (`--commit`)."""
    rec = base_record(run_id or new_run_id(), system, commit=git_commit(commit))
    if device is not None:
        rec["device"] = device
    return {**rec, "benchmark": benchmark, "workload": workload, "model": model,
            "gpu_memory_gib": size_gib(gpu_memory), "tokens_per_s": None, "rows_per_h": None,
            "peak_device_gib": None}


def save_record(path: str | Path, record: dict[str, Any], *, indent: int | None = 2) -> Path:
    """Write `record` atomically to `path` and say where on stderr; returns the path."""
    write_json_atomic(path, record, indent=indent)
    print(f"wrote {path}", file=sys.stderr)
    return Path(path)


def torch_device(name: str = "auto") -> Any:
    """`torch.device` for "auto" (cuda when there is one, else cpu), "cpu", "cuda", "cuda:1"..."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def failure_fields(err: BaseException) -> dict[str, Any]:
    """A failed configuration's record fields: ok False, the error named, the traceback's tail."""
    import traceback

    return {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-2000:]}


def close_and_release(engine: Any) -> None:
    """Close `engine` (an executor or a set of them; None: nothing opened) and give its memory back."""
    if engine is not None:
        engine.close()
    release_memory()


def release_memory() -> None:
    """Give a closed executor's memory back: device blocks and the pinned host blocks torch caches."""
    import gc

    gc.collect()
    if cuda_available():
        import torch

        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()


SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync")


def trace_summary(prof: Any, wall_s: float, rows: int = 15) -> dict[str, Any]:
    """What a `torch.profiler.profile` of `wall_s` seconds says about where the time went: the device's
    kernel seconds and copy seconds (its own events, each counted once), the kernels' fraction of the wall
    (below 1: the device waited for the host), the host-side synchronizing calls and their seconds, the
    kernels launched, and the top ops by device and by host time (tables)."""
    from torch.autograd import DeviceType

    device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    copy_s = sum(e.device_time_total for e in device if e.name.startswith(("Memcpy", "Memset"))) / 1e6
    kernel_s = sum(e.device_time_total for e in device) / 1e6 - copy_s
    averages = prof.key_averages()
    syncs = {e.key: {"calls": e.count, "host_s": e.cpu_time_total / 1e6} for e in averages if e.key in SYNC_CALLS}
    launches = sum(e.count for e in averages if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC"))
    return {"wall_s": wall_s, "kernel_s": kernel_s, "copy_s": copy_s,
            "kernel_fraction": kernel_s / wall_s if wall_s else None, "kernel_launches": launches,
            "sync_calls": syncs,
            "by_device_time": averages.table(sort_by="self_cuda_time_total", row_limit=rows),
            "by_host_time": averages.table(sort_by="self_cpu_time_total", row_limit=rows)}


def with_layers(loaded: Any, layers: int) -> Any:
    """A dummy preset's model cut to its first `layers` decoder layers (the same shapes and weights per
    layer): per-layer costs measured at a fraction of the full model's placement time."""
    import dataclasses

    from engine.models.registry import build_family

    config = dataclasses.replace(loaded.config, num_hidden_layers=layers)
    return dataclasses.replace(loaded, config=config, family=build_family(config),
                               fingerprint=f"{loaded.fingerprint}-{layers}L")
