"""The cached `HardwareProfile` of this machine: its file, reading, writing, and `load_or_measure`.

The cache file is keyed by hostname + device name + torch version (`machine.profile_key`), lives in
`$LLMOPS_CACHE_DIR` or `~/.cache/llmops`, is written to a temporary name and renamed into place, and is
re-measured (never used) when it does not parse or its key differs. The microbenchmark itself is
`engine.calibrate.measure`.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import torch

from engine.calibrate import measure as measure_mod
from engine.calibrate.machine import profile_key
from engine.policy.hardware import HardwareProfile
from engine.storage.atomic import write_json_atomic
from engine.util.paths import cache_dir

# 2: executor slot, CPU attention and dequantization probes; 3: slot extras by placement; 4: the 4-bit CPU
# attention probe times the rotated-basis path (NUMERICS_VERSION 4), 8-20x faster than the one measured before;
# 5: the device's fused 4-bit decode attention
PROFILE_VERSION = 5


def profile_cache_path(device: torch.device | str, directory: Path | None = None) -> Path:
    """Where this machine's profile for `device` ("cuda", "cpu" or a torch.device) is cached."""
    key = profile_key(torch.device(device))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (directory or cache_dir()) / f"hardware-{digest}.json"


def save_profile(profile: HardwareProfile, path: Path) -> None:
    """Write atomically: a temporary file in the same folder, fsync, rename into place."""
    write_json_atomic(path, {"version": PROFILE_VERSION, "profile": profile.to_dict()})


def load_profile(path: Path | str) -> HardwareProfile:
    """Read a profile JSON (the cache format `{"version", "profile"}` or a bare profile dict).
    Raises ValueError naming the file when it does not parse or a field is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"hardware profile {path}: cannot read JSON ({exc})") from exc
    if isinstance(data, dict) and "profile" in data:
        if data.get("version") not in range(1, PROFILE_VERSION + 1):
            raise ValueError(f"hardware profile {path}: version {data.get('version')!r}, "
                             f"expected {PROFILE_VERSION}")
        data = data["profile"]
    return _parse(data, path)


def _parse(data: Any, path: Path) -> HardwareProfile:
    """A profile dict -> HardwareProfile; ValueError naming the file when it is not one."""
    if not isinstance(data, dict):
        raise ValueError(f"hardware profile {path}: expected a JSON object")
    try:
        return HardwareProfile.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"hardware profile {path}: {exc}") from exc


def load_cached_profile(device: torch.device, directory: Path | None = None) -> HardwareProfile | None:
    """The cached profile of this machine and device, or None when absent, corrupt, for another key or
    written by another PROFILE_VERSION's probes (`load_or_measure` then measures again)."""
    path = profile_cache_path(device, directory)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
        return None                      # not a cache file, or measured by older probes: measure again
    try:
        profile = _parse(data["profile"], path)
    except (KeyError, ValueError):
        return None
    key = profile_key(device)
    if any(getattr(profile, k) != v for k, v in key.items()):
        return None
    if profile.source == "measured" and not (profile.slot_decode_ms and profile.slot_off_cache_ms):
        return None                      # measured before the executor probes existed: measure again
    return profile


def load_or_measure(
    device: torch.device | str | None = None,
    *,
    directory: Path | None = None,
    refresh: bool = False,
    measure_fn: Callable[..., HardwareProfile] | None = None,
    **measure_kwargs: Any,
) -> HardwareProfile:
    """This machine's profile: the cached one when valid, else measured (under a minute) and cached.

    `refresh` re-measures even when a valid cache exists. A corrupt or mismatched cache file is replaced.
    `measure_fn` (default `engine.calibrate.measure.measure`) is called as `measure_fn(device, **measure_kwargs)`.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not refresh:
        cached = load_cached_profile(device, directory)
        if cached is not None:
            return cached
    if measure_fn is None:
        measure_fn = measure_mod.measure    # looked up at call time, so a test can replace it
    profile = measure_fn(device, **measure_kwargs)
    save_profile(profile, profile_cache_path(device, directory))
    return profile
