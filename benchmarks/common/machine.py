"""What a record says about where it ran: the commit, the host, the accelerator, and the machine's short name
that names its folder under benchmarks/records/.

Commit capture works without a `.git` (a GPU host may get a copy of the working tree): an explicit value
(`--commit`), then `$LLMOPS_COMMIT` ("<sha>" or "<sha>-dirty"), then `git rev-parse HEAD` + dirtiness. Torch is
imported only by the functions that ask about the device.
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024 ** 3


def git_commit(explicit: str | None = None, root: Path = ROOT) -> dict[str, Any]:
    """{"sha", "dirty", "source"}: `explicit` (e.g. --commit), else $LLMOPS_COMMIT, else git (HEAD + whether
    tracked files differ); sha None when none is known. A trailing "-dirty" in a given value sets dirty."""
    def parse(value: str, source: str) -> dict[str, Any]:
        value = value.strip()
        dirty = value.endswith(("-dirty", "+dirty"))
        return {"sha": value[:-6] if dirty else value, "dirty": dirty if dirty else None, "source": source}

    if explicit:
        return parse(explicit, "argument")
    if os.environ.get("LLMOPS_COMMIT"):     # before git: a copied tree may carry a stale .git
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


def machine_slug(gpu_name: str | None = None, cpus: int | None = None) -> str:
    """The machine's folder under benchmarks/records/: $LLMOPS_MACHINE when set; else the GPU's model in lower
    case ("NVIDIA H100 80GB HBM3" -> "h100"; a name without such a model: its slug); else "cpu-<N>core"."""
    if os.environ.get("LLMOPS_MACHINE"):
        return os.environ["LLMOPS_MACHINE"]
    if gpu_name is None and cpus is None and cuda_available():
        gpu_name = device_name()
    if gpu_name:
        model = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", gpu_name)
        if model:
            return model.group(1).lower()
        return "".join(c if c.isalnum() else "-" for c in gpu_name.lower()).strip("-")
    return f"cpu-{cpus or os.cpu_count()}core"


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
