"""Ordering prompts into blocks: sort by token length, cut into blocks of the policy's block size.

Sorting keeps each block's prompts of similar length, so little compute goes to padding. No dedupe here
(the operator layer dedupes). Pure functions over lengths and indices; results map back by the indices.
"""
from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def plan_blocks(lengths: Sequence[int], block_size: int) -> list[list[int]]:
    """Indices into `lengths`, sorted by length (ascending, ties in input order), cut into blocks of at
    most `block_size`. Every index appears in exactly one block."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[start:start + block_size] for start in range(0, len(order), block_size)]


def scatter(results: Sequence[T], indices: Sequence[int], out: list[T | None]) -> None:
    """Write results[k] to out[indices[k]] (block order -> input order)."""
    if len(results) != len(indices):
        raise ValueError(f"{len(results)} results for {len(indices)} indices")
    for index, result in zip(indices, results):
        out[index] = result
