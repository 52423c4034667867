"""llama.cpp for `cpu_peers.py`: `llama-cpp-python` built from its source distribution for this CPU, outside the
repository, once per machine.

The build lives in `<cache>/peers/llama-cpp-python/` (`<cache>`: $LLMOPS_CACHE_DIR or ~/.cache/llmops) as a
`--target` folder (`site/`) the worker process puts on its path; the project's environment is never touched.
It is made by `pip download --no-binary :all: --no-deps llama-cpp-python` and `pip install --no-deps --target`
with `cmake_args()`: the instruction sets this CPU reports (/proc/cpuinfo: AVX2, AVX-512 and its VNNI,
VBMI and BF16 extensions...), as ggml's native build would take them, less AMX (ggml's AMX matmul stopped
on an illegal `tilezero` in a virtual machine whose CPU reports AMX, so its AVX-512 kernels run instead, as on
a CPU without AMX; ggml's native build cannot leave AMX out); the multimodal library, tools, examples and
tests off. Plus `diskcache`, the one import of the package
the project's environment lacks. A `built.json` beside it names the version and the CMake arguments; a folder
without it is built again. The build has a time limit (default 10 minutes); past it, or when pip or the
compiler fails, `ensure_llama_cpp` returns None and the reason, and the harness records llama.cpp as skipped.
CMake's build folder (`build/`) is kept, so a build cut off by its limit resumes where it stopped on the
next run (a busy 2-core machine compiles llama.cpp in more than one limit).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

_BASE_ARGS = ("-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
              "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF "
              "-DGGML_AMX_BF16=OFF")
# /proc/cpuinfo flag -> the ggml option that compiles for it (x86)
_ISA_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2",
                "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
                "avx512_bf16": "GGML_AVX512_BF16", "avx_vnni": "GGML_AVX_VNNI"}
BUILD_LIMIT_S = 600


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where it is absent)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("flags") and ":" in line:
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cmake_args(flags: set[str] | None = None) -> str:
    """The CMake arguments: every ggml x86 option this CPU's flags allow (ggml's native build less AMX), or
    ggml's native build where the flags are unknown (not x86 Linux)."""
    flags = cpu_flags() if flags is None else flags
    if not flags & set(_ISA_OPTIONS):
        return _BASE_ARGS.replace("-DGGML_NATIVE=OFF", "-DGGML_NATIVE=ON")
    return " ".join([_BASE_ARGS, *(f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in _ISA_OPTIONS.items())])


def peers_dir() -> Path:
    """`$LLMOPS_CACHE_DIR/peers` or `~/.cache/llmops/peers`."""
    base = os.environ.get("LLMOPS_CACHE_DIR") or Path.home() / ".cache" / "llmops"
    return Path(base) / "peers"


def built_site(folder: Path) -> Path | None:
    """The `site/` folder of a finished build in `folder`, else None."""
    marker = folder / "built.json"
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    site = folder / "site"
    return site if data.get("cmake_args") == cmake_args() and (site / "llama_cpp").is_dir() else None


def _pip(args: list[str], deadline: float, log: Path, env: dict[str, str] | None = None) -> str | None:
    """Run `python -m pip args` until `deadline` (time.monotonic), its output appended to `log`; None when it
    succeeded, else why not."""
    left = deadline - time.monotonic()
    if left <= 0:
        return f"the build ran past its {BUILD_LIMIT_S} s limit"
    with log.open("a") as out:
        try:
            done = subprocess.run([sys.executable, "-m", "pip", *args], stdout=out, stderr=subprocess.STDOUT,
                                  env=env, timeout=left, check=False)
        except subprocess.TimeoutExpired:
            return f"pip {args[0]} ran past the build's limit of {BUILD_LIMIT_S} s (log: {log})"
    return None if done.returncode == 0 else f"pip {args[0]} failed with exit code {done.returncode} (log: {log})"


def ensure_llama_cpp(folder: Path | None = None, limit_s: float = BUILD_LIMIT_S) -> tuple[Path | None, str]:
    """(the `site/` folder holding the built `llama_cpp` package, "") once built, building it now if needed
    within `limit_s` seconds; (None, the reason) when it cannot be built."""
    folder = folder or peers_dir() / "llama-cpp-python"
    site = built_site(folder)
    if site is not None:
        return site, ""
    if shutil.which("cmake") is None or shutil.which("c++") is None and shutil.which("g++") is None:
        return None, "building llama-cpp-python needs cmake and a C++ compiler on PATH"
    deadline = time.monotonic() + limit_s
    shutil.rmtree(folder / "site", ignore_errors=True)
    (folder / "sdist").mkdir(parents=True, exist_ok=True)
    log = folder / "build.log"
    sdists = sorted((folder / "sdist").glob("llama_cpp_python-*.tar.gz"))
    why = None if sdists else _pip(["download", "--no-binary", ":all:", "--no-deps", "-d", str(folder / "sdist"),
                                    "llama-cpp-python"], deadline, log)
    sdists = sorted((folder / "sdist").glob("llama_cpp_python-*.tar.gz"))
    if why is None and not sdists:
        why = "pip download gave no llama_cpp_python source distribution"
    if why is not None:
        return None, why
    args = cmake_args()
    env = {**os.environ, "CMAKE_ARGS": args, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    site = folder / "site"
    why = (_pip(["install", "--no-deps", "--target", str(site), "--config-settings", f"build-dir={folder / 'build'}",
                 str(sdists[-1])], deadline, log, env)
           or _pip(["install", "--no-deps", "--target", str(site), "diskcache"], deadline, log))
    if why is not None:
        return None, why
    version = sdists[-1].name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    (folder / "built.json").write_text(json.dumps({"version": version, "cmake_args": args}))
    return site, ""
