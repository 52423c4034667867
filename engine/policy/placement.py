"""Pure placement rules: which tier holds each weight tensor, and which index range of a split tensor.

Tiers are named by `TIERS` ("gpu", "cpu", "disk"; the runtime's `engine.storage.tiers.Tier` has the same
values). Weights: FlexGen's rule per layer: tensors in order, each goes to the tier whose cumulative-fraction
interval contains the midpoint of the tensor's byte range; then (`with_extra`, `Policy.w_gpu_extra`) the first
off-gpu tensor of each of the first n layers that have one moves to the gpu as well, so a plan can use the
device memory a whole tensor per layer leaves. KV cache and activations: a dim of n items (kv heads, hidden
features) is cut into contiguous gpu/cpu/disk ranges by rounded cumulative fractions.
"""
from __future__ import annotations

from typing import Sequence

TIERS: tuple[str, str, str] = ("gpu", "cpu", "disk")


def weight_tiers(sizes: Sequence[int], w_gpu: float, w_cpu: float) -> list[str]:
    """Tier of each tensor of one layer given its byte `sizes` in order."""
    total = sum(sizes) or 1
    tiers, start = [], 0
    for size in sizes:
        mid = (start + size / 2) / total
        start += size
        if mid < w_gpu:
            tiers.append("gpu")
        elif mid < w_gpu + w_cpu:
            tiers.append("cpu")
        else:
            tiers.append("disk")
    return tiers


def first_off_gpu(tiers: Sequence[str]) -> int | None:
    """The index of a layer's first tensor off the gpu (the one `with_extra` moves), None when all are on it."""
    return next((n for n, tier in enumerate(tiers) if tier != "gpu"), None)


def with_extra(layers: Sequence[Sequence[str]], extra: int) -> list[list[str]]:
    """`layers` (each layer's tensor tiers, in the executor's layer order) with the first tensor off the gpu of
    each of the first `extra` layers that have one placed on the gpu instead (`Policy.w_gpu_extra`)."""
    out, left = [list(tiers) for tiers in layers], extra
    for tiers in out:
        if left <= 0:
            break
        off = first_off_gpu(tiers)
        if off is not None:
            tiers[off] = "gpu"
            left -= 1
    return out


def split_ranges(n: int, gpu: float, cpu: float) -> list[tuple[str, int, int]]:
    """Non-empty contiguous ranges [start, end) of n items per tier, in gpu, cpu, disk order."""
    a = round(gpu * n)
    b = max(a, min(n, round((gpu + cpu) * n)))
    ranges = [("gpu", 0, a), ("cpu", a, b), ("disk", b, n)]
    return [r for r in ranges if r[2] > r[1]]
