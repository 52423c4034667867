"""Named, reusable buffers on every tier, counted against the tiers' hard budgets, handed out by the plan.

The executor gives the arena its buffer plan (`plan`, an `engine.policy.buffers.BufferPlan`): `get(key, ...)`
then returns a view of the planned buffer named `key`, allocated at the plan's size (the plan's shape, dtype
and 4-bit grouping) when first asked for and grown when a later plan makes it larger, so blocks of similar
shapes reuse their KV-cache homes and staging buffers instead of allocating (and pinning) every block. A name
outside the plan, or a request its planned buffer cannot hold (another tier, dtype or grouping, more bytes),
raises `PlanViolation`: a buffer the runtime would allocate but the memory model does not count. Without a
plan (a standalone cache home in a test or a microbenchmark) a buffer is the size asked for, grown when a
request exceeds it. `held` records every buffer the arena holds, as the plan entry it was allocated by, and
`asked` the most bytes handed out of each (a plan tighter than its use leaves memory the budget counts idle).
A planned buffer torch must allocate itself (a oneDNN-reordered weight) is `hold_elsewhere`'s: counted, not
allocated here.
A grown cpu buffer's old space goes back to the pinned pool for the next growth. Contents are uninitialised.
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine.policy.buffer_spec import BufferPlan, BufferSpec
from engine.policy.dtypes import dtype_name, numel, quant_parts, stored_nbytes
from engine.quant.config import QuantConfig
from engine.quant.qtensor import QTensor
from engine.storage.disk import ScratchFiles
from engine.storage.pinned import HostPool
from engine.storage.tiers import MemoryBudget, Stored, Tier, stored_nbytes as value_nbytes


class PlanViolation(RuntimeError):
    """The runtime asked for a buffer its plan does not hold (a bug: the memory model would not count it)."""


class Arena:
    def __init__(self, device: torch.device, budget: MemoryBudget, disk_dir: Path | None):
        self.device = device
        self.budget = budget
        self.host = HostPool(pin=device.type == "cuda")
        self.disk_dir = disk_dir
        self._scratch: ScratchFiles | None = None
        self._flat: dict[str, tuple[Tier, torch.Tensor]] = {}
        self._elsewhere: dict[str, tuple[Tier, int]] = {}    # buffers held as tensors torch allocated
        self._plan: dict[str, BufferSpec] | None = None
        self._granted: dict[tuple, tuple] = {}     # request -> its buffer's parts (`_grant`), until a new plan
        self.held: dict[str, BufferSpec] = {}
        self.asked: dict[str, int] = {}

    def plan(self, plan: BufferPlan) -> None:
        """Hand out `plan`'s buffers from now on (and only those)."""
        self._plan = plan.buffers()
        self._granted.clear()

    def entry(self, key: str) -> BufferSpec:
        """The planned buffer `key` (PlanViolation when the plan has none)."""
        spec = None if self._plan is None else self._plan.get(key)
        if spec is None:
            raise PlanViolation(f"buffer {key!r} is not in the executor's buffer plan")
        return spec

    def get(self, key: str, tier: Tier, shape: tuple[int, ...], dtype: torch.dtype,
            quant: QuantConfig | None = None) -> Stored:
        """A buffer of `shape` on `tier`: dense, or a QTensor of that logical shape when `quant` is given."""
        request = (key, tier, tuple(shape), dtype, quant)
        parts = self._granted.get(request)
        if parts is None:
            parts = self._granted[request] = self._grant(key, tier, tuple(shape), dtype_name(dtype), quant)
        if quant is None:
            return self._view(key, tier, *parts[0][1:])
        data, mn, scale = (self._view(f"{key}.{part[0]}", tier, *part[1:]) for part in parts)
        return QTensor(data, mn, scale, torch.Size(shape), quant, dtype)

    def _grant(self, key: str, tier: Tier, shape: tuple[int, ...], dtype: str,
               quant: QuantConfig | None) -> tuple[tuple[str, int, tuple[int, ...], str], ...]:
        """Check a request against the plan (PlanViolation when it does not fit), record the buffer it is
        handed out of, and return that buffer's dense parts: (suffix, bytes to hold, the request's view shape,
        dtype name) each."""
        want = BufferSpec(key, tier.value, shape, dtype, "unplanned", quant)
        if self._plan is None:
            held = self.held.get(key)
            spec = held if held is not None and _holds(held, want) else want
        else:
            spec = self.entry(key)
            if not _holds(spec, want):
                raise PlanViolation(f"buffer {key!r}: asked for {tier.value} {list(shape)} {dtype}"
                                    f"{' 4-bit' if quant else ''}, planned {spec.tier} {list(spec.shape)} "
                                    f"{spec.dtype}{' 4-bit' if spec.quant else ''}")
        held = self.held.get(key)
        if held is None or not _holds(held, spec):
            self.held[key] = held = spec
        self.asked[key] = max(self.asked.get(key, 0), want.nbytes)
        if quant is None:
            return (("", held.nbytes, shape, dtype),)
        return tuple((part, numel(planned) * _size(pdt), view, pdt)
                     for (part, planned, pdt), (_, view, _) in zip(quant_parts(held.shape, dtype, quant),
                                                                  quant_parts(shape, dtype, quant)))

    def adopt(self, key: str, value: Stored) -> Stored:
        """Record `value`, a planned buffer held elsewhere (a weight file mapped from disk), as this arena's."""
        spec = self.entry(key)
        if spec.tier != Tier.DISK.value or value_nbytes(value) != spec.nbytes:
            raise PlanViolation(f"buffer {key!r}: a mapped file of {value_nbytes(value)} bytes, planned "
                                f"{spec.tier} {spec.nbytes} bytes")
        self.held[key] = spec
        self.asked[key] = spec.nbytes
        return value

    def hold_elsewhere(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """Hold the planned buffer `key` as `value` from now on: the same tensor, as many bytes, in a form
        torch allocated itself (a weight reordered into oneDNN's layout). The arena's copy goes back; the
        budget counts `value`'s bytes under `key` until it is dropped."""
        spec = self.entry(key)
        nbytes = value.numel() * value.element_size()
        if nbytes != spec.nbytes:
            raise PlanViolation(f"buffer {key!r}: held elsewhere as {nbytes} bytes, planned {spec.nbytes}")
        tier = Tier(spec.tier)
        held = self._flat.pop(key, None)
        if held is not None:
            self.budget.release(held[0], held[1].numel(), key)
            self._free(*held)
        self.budget.reserve(tier, nbytes, f"{key} held elsewhere")
        self._elsewhere[key] = (tier, nbytes)
        self.held[key] = spec
        self.asked[key] = max(self.asked.get(key, 0), nbytes)
        return value

    def _view(self, key: str, tier: Tier, nbytes: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        """A view [shape] of the first bytes of the flat buffer `key`, (re)allocated to `nbytes` when smaller;
        `dtype` a name."""
        held = self._flat.get(key)
        if held is None or held[0] != tier or held[1].numel() < nbytes:
            if held is not None:
                self.budget.release(held[0], held[1].numel(), key)
                del self._flat[key]
                self._free(*held)
            self.budget.reserve(tier, nbytes, f"{key} {list(shape)} {dtype}")
            self._flat[key] = (tier, self._alloc(tier, nbytes))
        return self._flat[key][1][:numel(shape) * _size(dtype)].view(getattr(torch, dtype)).view(shape)

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
        for key in [k for k, (tier, _) in self._elsewhere.items() if k.startswith(prefixes) and tier is not keep_tier]:
            tier, nbytes = self._elsewhere.pop(key)
            self.budget.release(tier, nbytes, key)
        keep = None if keep_tier is None else keep_tier.value
        for key in [k for k, spec in self.held.items() if k.startswith(prefixes) and spec.tier != keep]:
            del self.held[key]
            self.asked.pop(key, None)
        self._granted.clear()

    def close(self) -> None:
        for key, (tier, flat) in self._flat.items():
            self.budget.release(tier, flat.numel(), key)
        self._flat.clear()
        for key, (tier, nbytes) in self._elsewhere.items():
            self.budget.release(tier, nbytes, key)
        self._elsewhere.clear()
        self._granted.clear()
        self.held.clear()
        self.asked.clear()
        self.host.close()
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None


def _size(dtype: str) -> int:
    return stored_nbytes((1,), dtype)


def _holds(planned: BufferSpec, want: BufferSpec) -> bool:
    """Whether buffer `planned` can hold the request `want`: the same tier, dtype and grouping, and no part
    of it larger than the planned one's."""
    if (planned.tier, planned.dtype, planned.quant) != (want.tier, want.dtype, want.quant):
        return False
    if want.quant is None:
        return want.nbytes <= planned.nbytes
    return all(numel(w) <= numel(p) for (_, p, _), (_, w, _) in zip(quant_parts(planned.shape, planned.dtype,
                                                                               planned.quant),
                                                                   quant_parts(want.shape, want.dtype, want.quant)))
