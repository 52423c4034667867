"""`QTensor`: a 4-bit group-quantized tensor, a value any storage tier can hold (not a device).

Layout for a logical tensor of shape [*lead, d] with g = ceil(d / group_size) groups:
`data` uint8 [*lead, g, group_size // 2] (two 4-bit codes per byte, low nibble first),
`mn` and `scale` [*lead, g, 1] (float16 for half dtypes, else float32: see `scale_dtype`);
`dtype` is the logical (dequantized) dtype. Element = code * scale + mn.
Indexing and copies act on the leading dims only, so a KV cache can be written one position at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quant.config import QuantConfig


@dataclass
class QTensor:
    data: torch.Tensor      # [*lead, g, gs/2] uint8
    mn: torch.Tensor        # [*lead, g, 1]
    scale: torch.Tensor     # [*lead, g, 1]
    shape: torch.Size       # logical shape [*lead, d]
    config: QuantConfig
    dtype: torch.dtype      # logical dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.mn, self.scale))

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.data, self.mn, self.scale

    def __getitem__(self, index) -> "QTensor":
        """Index the leading dims (an int, slice or tuple of them that does not reach the last dim)."""
        idx = index if isinstance(index, tuple) else (index,)
        if len(idx) >= len(self.shape):
            raise IndexError(f"QTensor: index {index!r} reaches the quantized last dim of shape {tuple(self.shape)}")
        data = self.data[idx]
        lead = data.shape[:-2]
        return QTensor(data, self.mn[idx], self.scale[idx], torch.Size((*lead, self.shape[-1])), self.config,
                       self.dtype)

    def copy_(self, src: "QTensor", non_blocking: bool = False) -> "QTensor":
        for dst_part, src_part in zip(self.parts(), src.parts()):
            dst_part.copy_(src_part, non_blocking=non_blocking)
        return self

    def index_select(self, dim: int, index: torch.Tensor) -> "QTensor":
        if dim < 0 or dim >= len(self.shape) - 1:
            raise IndexError(f"QTensor.index_select: dim {dim} must be a leading dim of {tuple(self.shape)}")
        parts = [p.index_select(dim, index.to(p.device)) for p in self.parts()]
        shape = list(self.shape)
        shape[dim] = index.numel()
        return QTensor(*parts, torch.Size(shape), self.config, self.dtype)

    def transpose(self, d0: int, d1: int) -> "QTensor":
        """A view with leading dims d0 and d1 swapped (no copy)."""
        if not (0 <= d0 < len(self.shape) - 1 and 0 <= d1 < len(self.shape) - 1):
            raise IndexError(f"QTensor.transpose: dims {d0}, {d1} must be leading dims of {tuple(self.shape)}")
        shape = list(self.shape)
        shape[d0], shape[d1] = shape[d1], shape[d0]
        return QTensor(*(p.transpose(d0, d1) for p in self.parts()), torch.Size(shape), self.config, self.dtype)

    def contiguous(self) -> "QTensor":
        """The same values with every part contiguous (`self` when they already are)."""
        if all(p.is_contiguous() for p in self.parts()):
            return self
        return QTensor(*(p.contiguous() for p in self.parts()), self.shape, self.config, self.dtype)

    def narrow(self, dim: int, start: int, length: int) -> "QTensor":
        parts = [p.narrow(dim, start, length) for p in self.parts()]
        shape = list(self.shape)
        shape[dim] = length
        return QTensor(*parts, torch.Size(shape), self.config, self.dtype)


def empty_qtensor(shape: tuple[int, ...], dtype: torch.dtype, config: QuantConfig, *,
                  device: torch.device | str = "cpu", pin_memory: bool = False) -> QTensor:
    """An uninitialised QTensor of logical `shape` on `device`."""
    *lead, d = shape
    groups = -(-d // config.group_size)
    sdt = scale_dtype(dtype)
    data = torch.empty((*lead, groups, config.group_size // 2), dtype=torch.uint8, device=device, pin_memory=pin_memory)
    mn = torch.empty((*lead, groups, 1), dtype=sdt, device=device, pin_memory=pin_memory)
    scale = torch.empty((*lead, groups, 1), dtype=sdt, device=device, pin_memory=pin_memory)
    return QTensor(data, mn, scale, torch.Size(shape), config, dtype)


def with_dtype(q: QTensor, dtype: torch.dtype) -> QTensor:
    """`q` with logical dtype `dtype`: the same codes, min/scale cast to `scale_dtype(dtype)` (`q` itself when
    nothing changes)."""
    if q.dtype == dtype:
        return q
    sdt = scale_dtype(dtype)
    return QTensor(q.data, q.mn.to(sdt), q.scale.to(sdt), q.shape, q.config, dtype)


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of the stored min/scale: float16 for half types (bfloat16's 8-bit mantissa measurably
    raises a small model's perplexity), float32 otherwise."""
    return torch.float16 if dtype in (torch.float16, torch.bfloat16) else torch.float32


def qtensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype, config: QuantConfig) -> int:
    """Bytes of a QTensor of logical `shape` (codes + min + scale)."""
    *lead, d = shape
    n_lead = 1
    for x in lead:
        n_lead *= x
    groups = -(-d // config.group_size)
    return n_lead * groups * (config.group_size // 2 + 2 * torch.empty((), dtype=scale_dtype(dtype)).element_size())
