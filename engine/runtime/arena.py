"""Named, reusable buffers on every tier, counted against the tiers' hard budgets.

`get(key, tier, shape, dtype)` returns a view of the buffer named `key`, grown (re-allocated) only when the
requested size exceeds it, so blocks of similar shapes reuse their KV-cache homes and staging buffers
instead of allocating (and pinning) every block; a grown cpu buffer's old space goes back to the pinned
pool for the next growth. Contents are uninitialised.
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine.quant.config import QuantConfig
from engine.quant.qtensor import QTensor, scale_dtype
from engine.storage.disk import ScratchFiles
from engine.storage.pinned import HostPool
from engine.storage.tiers import MemoryBudget, Stored, Tier


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Arena:
    def __init__(self, device: torch.device, budget: MemoryBudget, disk_dir: Path | None):
        self.device = device
        self.budget = budget
        self.host = HostPool(pin=device.type == "cuda")
        self.disk_dir = disk_dir
        self._scratch: ScratchFiles | None = None
        self._flat: dict[str, tuple[Tier, torch.Tensor]] = {}

    def get(self, key: str, tier: Tier, shape: tuple[int, ...], dtype: torch.dtype,
            quant: QuantConfig | None = None) -> Stored:
        """A buffer of `shape` on `tier`: dense, or a QTensor of that logical shape when `quant` is given."""
        if quant is None:
            return self._dense(key, tier, shape, dtype)
        *lead, d = shape
        groups = -(-d // quant.group_size)
        data = self._dense(f"{key}.data", tier, (*lead, groups, quant.group_size // 2), torch.uint8)
        mn = self._dense(f"{key}.mn", tier, (*lead, groups, 1), scale_dtype(dtype))
        scale = self._dense(f"{key}.scale", tier, (*lead, groups, 1), scale_dtype(dtype))
        return QTensor(data, mn, scale, torch.Size(shape), quant, dtype)

    def _dense(self, key: str, tier: Tier, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        held = self._flat.get(key)
        if held is None or held[0] != tier or held[1].numel() < nbytes:
            if held is not None:
                self.budget.release(held[0], held[1].numel(), key)
                del self._flat[key]
                self._free(*held)
            self.budget.reserve(tier, nbytes, f"{key} {list(shape)} {str(dtype).removeprefix('torch.')}")
            self._flat[key] = (tier, self._alloc(tier, nbytes))
        flat = self._flat[key][1]
        return flat[:nbytes].view(dtype).view(shape)

    def _alloc(self, tier: Tier, nbytes: int) -> torch.Tensor:
        if tier is Tier.GPU:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if tier is Tier.CPU:
            return self.host.empty((nbytes,), torch.uint8)
        if self.disk_dir is None:
            raise ValueError("the policy puts KV cache or activations on disk but no disk_dir was given")
        if self._scratch is None:
            self._scratch = ScratchFiles(self.disk_dir)
        return self._scratch.empty((nbytes,), torch.uint8)

    def _free(self, tier: Tier, flat: torch.Tensor) -> None:
        """Give a replaced cpu-tier buffer back to the pool once no copy can still read or write it (the
        device is synchronized: replacements happen when a block's shapes grow, not per step)."""
        if tier is Tier.CPU and self.host.pooled:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.host.free(flat)

    def drop(self, prefixes: tuple[str, ...], keep_tier: Tier | None = None) -> None:
        """Give back every buffer whose key starts with one of `prefixes` (except those on `keep_tier`)."""
        for key in [k for k, (tier, _) in self._flat.items() if k.startswith(prefixes) and tier is not keep_tier]:
            tier, flat = self._flat.pop(key)
            self.budget.release(tier, flat.numel(), key)
            self._free(tier, flat)

    def close(self) -> None:
        for key, (tier, flat) in self._flat.items():
            self.budget.release(tier, flat.numel(), key)
        self._flat.clear()
        self.host.close()
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None
