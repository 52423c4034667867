"""Byte sizes written by people: "16GiB", "500GB", "1.5 TiB", "4096", 4096 -> int bytes.

Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (kB, MB, GB, TB) powers of 1000;
a bare number is bytes. Case and spaces are ignored. The one parser every budget option goes through.
"""
from __future__ import annotations

import re

_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int | float) -> int:
    """Parse a size into a non-negative number of bytes (rounded down).

    Raises ValueError naming the input when it is not a number with a known unit or is negative.
    """
    if isinstance(value, bool):
        raise ValueError(f"size must be a number of bytes or a string like '16GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value!r}")
        return int(value)
    match = _PATTERN.match(str(value))
    if match is None:
        raise ValueError(f"cannot parse size {value!r}: expected a number and a unit like '16GiB' or '500GB'")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(
            f"cannot parse size {value!r}: unknown unit {match.group(2)!r} "
            f"(known: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    return int(number * _UNITS[unit])


def format_size(nbytes: int | float) -> str:
    """Human-readable binary size, e.g. 17179869184 -> '16.00 GiB'."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
