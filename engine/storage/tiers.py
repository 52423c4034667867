"""Storage tiers, the tensor handle type and the hard memory budgets of the tiers.

Tiers: `gpu` is the compute device (the CPU itself on a machine without a GPU), `cpu` is host RAM (pinned
when a GPU exists), `disk` is memory-mapped files under a disk_dir. A `Handle` names a stored value and
its home tier; the value is a dense tensor or a 4-bit `QTensor` (compression is a value type, not a tier).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from engine.quant.qtensor import QTensor
from engine.util.sizes import format_size

Stored = torch.Tensor | QTensor


class Tier(str, enum.Enum):
    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"


@dataclass
class Handle:
    """A stored value and its home tier."""

    tier: Tier
    value: Stored

    @property
    def nbytes(self) -> int:
        return stored_nbytes(self.value)


def stored_nbytes(value: Stored) -> int:
    if isinstance(value, QTensor):
        return value.nbytes
    return value.numel() * value.element_size()


class BudgetExceeded(torch.OutOfMemoryError):
    """A tier's hard budget cannot hold an allocation; the message says what, how much and the budget.

    A `torch.OutOfMemoryError`, so callers that retry a block with a smaller batch on OOM treat both alike."""


class MemoryBudget:
    """Counts the bytes the engine holds per tier against hard limits (None = unlimited).

    `reserve` fails fast, before allocating, with a message naming the tier, the item and the numbers.
    """

    def __init__(self, limits: dict[Tier, int | None]):
        self.limits = dict(limits)
        self.used = {tier: 0 for tier in Tier}
        self.peak = {tier: 0 for tier in Tier}
        self.items: dict[Tier, dict[str, int]] = {tier: {} for tier in Tier}

    def reserve(self, tier: Tier, nbytes: int, what: str) -> None:
        limit = self.limits.get(tier)
        if limit is not None and self.used[tier] + nbytes > limit:
            top = sorted(self._by_kind(tier).items(), key=lambda kv: -kv[1])[:4]
            held = ", ".join(f"{name} {format_size(n)}" for name, n in top) or "nothing"
            raise BudgetExceeded(
                f"{tier.value} memory budget exceeded: {what} needs {format_size(nbytes)} but "
                f"{format_size(self.used[tier])} of the {format_size(limit)} budget is already held "
                f"({held}); use a smaller batch, move weights/cache off the {tier.value} tier, or compress"
            )
        self.used[tier] += nbytes
        self.peak[tier] = max(self.peak[tier], self.used[tier])
        kind = _kind(what)
        self.items[tier][kind] = self.items[tier].get(kind, 0) + nbytes

    def release(self, tier: Tier, nbytes: int, what: str) -> None:
        """Give back `nbytes` reserved on `tier` under the name `what` (as passed to `reserve`)."""
        self.used[tier] = max(0, self.used[tier] - nbytes)
        kind = _kind(what)
        self.items[tier][kind] = max(0, self.items[tier].get(kind, 0) - nbytes)

    def _by_kind(self, tier: Tier) -> dict[str, int]:
        return {k: n for k, n in self.items[tier].items() if n > 0}


def _kind(what: str) -> str:
    """The family of a budget item for messages: 'kv.3.1.s0.k [..]' -> 'kv', 'home.layers.0.mlp.x' -> 'home'."""
    head = what.split(" ")[0]
    return head.split(".")[0] if "." in head else what
