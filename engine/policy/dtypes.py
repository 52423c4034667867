"""Element types as names, and the stored bytes of a dense or 4-bit tensor (pure arithmetic, no tensors).

A dtype is named as torch prints it without the prefix ("float16", "bfloat16", "float32", "uint8"); a torch
dtype passed in is read by that name, so callers holding tensors need no conversion. A 4-bit tensor of
logical shape [*lead, d] is stored as `engine.quant.qtensor.QTensor` lays it out: codes uint8
[*lead, g, group_size / 2] and a min and a scale [*lead, g, 1] each (g = ceil(d / group_size)), the min and
scale in `scale_dtype` of the logical dtype.
"""
from __future__ import annotations

from typing import Any, Sequence

from engine.quant.config import QuantConfig

DTYPE_BYTES: dict[str, int] = {"uint8": 1, "int8": 1, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_ALIASES = {"half": "float16", "float": "float32", "double": "float64"}
_OF_SIZE = {2: "float16", 4: "float32", 8: "float64"}


def dtype_name(dtype: Any) -> str:
    """The name of `dtype` (a name, an alias such as "half", or a torch dtype)."""
    name = str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    return name


def element_size(dtype: Any) -> int:
    """Bytes per element of `dtype` (an int is taken as the size itself)."""
    return dtype if isinstance(dtype, int) else DTYPE_BYTES[dtype_name(dtype)]


def dtype_of_size(bytes_per_element: int) -> str:
    """The floating dtype a memory estimate of `bytes_per_element` counts in (2: float16, as bfloat16)."""
    if bytes_per_element not in _OF_SIZE:
        raise ValueError(f"bytes_per_element must be one of {sorted(_OF_SIZE)}, got {bytes_per_element}")
    return _OF_SIZE[bytes_per_element]


def scale_dtype(dtype: str) -> str:
    """The dtype of a 4-bit tensor's min and scale: float16 for half types, float32 otherwise (as
    `engine.quant.qtensor.scale_dtype`)."""
    return "float16" if dtype in ("float16", "bfloat16") else "float32"


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def quant_parts(shape: Sequence[int], dtype: str, quant: QuantConfig) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """The (suffix, shape, dtype) of the dense parts a 4-bit tensor of logical `shape` is stored in."""
    *lead, d = shape
    groups = -(-d // quant.group_size)
    sdt = scale_dtype(dtype)
    return (("data", (*lead, groups, quant.group_size // 2), "uint8"),
            ("mn", (*lead, groups, 1), sdt), ("scale", (*lead, groups, 1), sdt))


def stored_nbytes(shape: Sequence[int], dtype: str, quant: QuantConfig | None = None) -> int:
    """Bytes of a tensor of `shape` and `dtype`, dense or (`quant`) 4-bit."""
    if quant is None:
        return numel(shape) * DTYPE_BYTES[dtype]
    return sum(numel(s) * DTYPE_BYTES[t] for _, s, t in quant_parts(shape, dtype, quant))
