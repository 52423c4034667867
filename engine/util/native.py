"""C kernels shipped as source and built for this machine at first use: the system C compiler turns one file
into a shared library, kept in the cache folder and loaded with ctypes.

A kernel is optional by design: its caller falls back to torch ops when `build_library` raises
`NativeUnavailable` (not Linux, a CPU without the instruction sets the kernel is written for, no C compiler).
A compiler that fails on the source raises RuntimeError with its message (the caller warns and falls back).

The library lives at `<cache_dir()>/native/<stem>-<digest>.so`, the digest over the source and the headers it
includes by quotes (beside it), the flags, the compiler's path, size and modification time and the machine's
architecture: an edited source or header, other flags or an upgraded compiler build anew, an unchanged one is
loaded in a millisecond. It is compiled to a temporary
name beside it and renamed into place under a lock file, so processes starting at once build it once. Libraries
compiled with -fopenmp bind to the libgomp torch has already loaded (one thread pool in the process).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Callable

from engine.util.paths import cache_dir, locked

_COMPILE_LIMIT_S = 120
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)     # a header beside the source
# the flags and /proc/cpuinfo features of a kernel written for AVX-512 with its bfloat16 instructions
AVX512_BF16_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC")
AVX512_BF16_CPU = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})


class NativeUnavailable(Exception):
    """This machine cannot run the kernel (the message says why); the caller uses its torch ops."""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (/proc/cpuinfo); empty where it is absent."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def compiler() -> Path | None:
    """The C compiler: `$CC`, else `cc`, else `gcc` on the PATH; None when there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        found = shutil.which(name) if name else None
        if found:
            return Path(found)
    return None


def library_path(source: Path, flags: tuple[str, ...], cc: Path, directory: Path | None = None) -> Path:
    """Where the library built from `source` with `flags` by `cc` lives (module docstring)."""
    st = cc.stat()
    key = hashlib.sha256()
    text = source.read_bytes()
    headers = [(source.parent / name).read_bytes() for name in _LOCAL_INCLUDE.findall(text.decode())]
    for part in (text, *headers, "\0".join(flags).encode(), str(cc.resolve()).encode(),
                 f"{st.st_size}:{st.st_mtime_ns}".encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return (directory or cache_dir() / "native") / f"{source.stem}-{key.hexdigest()[:16]}.so"


def build_library(source: Path, flags: tuple[str, ...], requires: frozenset[str] = frozenset(),
                  directory: Path | None = None) -> ctypes.CDLL:
    """`source` compiled with `flags` (cached, module docstring) and loaded. `requires`: the /proc/cpuinfo
    flags the kernel needs. Raises NativeUnavailable when this machine cannot run it, RuntimeError when the
    compiler fails."""
    if platform.system() != "Linux":
        raise NativeUnavailable(f"{source.name}: built on Linux only, this is {platform.system()}")
    missing = requires - cpu_flags()
    if missing:
        raise NativeUnavailable(f"{source.name}: this CPU lacks {', '.join(sorted(missing))}")
    cc = compiler()
    if cc is None:
        raise NativeUnavailable(f"{source.name}: no C compiler ($CC, cc or gcc) on the PATH")
    path = library_path(source, flags, cc, directory)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path):
            if not path.exists():                       # another process may have built it while we waited
                _compile(cc, source, flags, path)
    return ctypes.CDLL(str(path))


def _compile(cc: Path, source: Path, flags: tuple[str, ...], path: Path) -> None:
    """cc `flags` -o <temporary> `source`, renamed to `path`; RuntimeError with the compiler's message."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        done = subprocess.run([str(cc), *flags, "-o", str(tmp), str(source)], capture_output=True, text=True,
                              timeout=_COMPILE_LIMIT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} could not build {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def checked_library(what: str, source: Path, flags: tuple[str, ...], requires: frozenset[str],
                    check: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """`build_library`, then `check(library)` (declares its functions' argument types and compares them with
    torch's ops, raising on a mismatch): the library, or None where this machine cannot run it (silently) or
    it fails to build or to match (a RuntimeWarning naming `what`; torch's ops run instead)."""
    try:
        library = build_library(source, flags, requires)
        check(library)
        return library
    except NativeUnavailable:
        return None
    except Exception as exc:
        warnings.warn(f"{what}: the C kernel failed on this CPU ({exc!r}); using torch ops", RuntimeWarning,
                      stacklevel=3)
        return None


def checked_kernel(what: str, source: Path, name: str, argtypes: list, restype: object,
                   check: Callable[[Callable[..., object]], None]) -> Callable[..., object] | None:
    """`checked_library` of an AVX512-BF16 `source` whose one kernel is `name`: its argument and result types
    declared (ctypes), then `check(kernel)`; the kernel, or None where `checked_library` gives None."""
    def bind(library: ctypes.CDLL) -> None:
        kernel = getattr(library, name)
        kernel.argtypes, kernel.restype = argtypes, restype
        check(kernel)

    library = checked_library(what, source, AVX512_BF16_FLAGS, AVX512_BF16_CPU, bind)
    return None if library is None else getattr(library, name)
