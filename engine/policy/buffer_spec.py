"""The buffer plan as data: `BufferSpec` (one buffer, or many alike), `BufferPlan` (every buffer of a run), and
the workload a plan is made for (`BlockShape`: a block's GPU batches and steps). `engine.policy.buffers` makes
plans; the runtime's arena hands out their buffers (`engine.runtime.arena`).

An entry with `index` names many buffers alike (`BufferSpec.names`: the KV-cache homes of every attention layer
and GPU batch are one entry), so the plan of a large model is a few hundred entries and the memory model, which
makes thousands of plans in a search, stays cheap.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import Iterator, Sequence

from engine.policy.dtypes import stored_nbytes
from engine.policy.policy import Policy
from engine.quant.config import QuantConfig


@dataclass(frozen=True)
class BufferSpec:
    """One buffer, or (`index`) `count` buffers alike: the name (with `index`, a template whose {} take each
    combination of its tuples' values, `names`), tier ("gpu", "cpu", "disk"), shape in memory (4-bit: the
    logical shape, grouped along the last dim by `quant`), dtype name and the runtime part that uses it.
    `nbytes` is one buffer's."""

    name: str
    tier: str
    shape: tuple[int, ...]
    dtype: str
    owner: str
    quant: QuantConfig | None = None
    index: tuple[tuple, ...] = ()
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", stored_nbytes(self.shape, self.dtype, self.quant))

    @property
    def count(self) -> int:
        n = 1
        for values in self.index:
            n *= len(values)
        return n

    @property
    def total(self) -> int:
        return self.count * self.nbytes

    def names(self) -> Iterator[str]:
        """Every buffer name this entry stands for."""
        if not self.index:
            yield self.name
            return
        for combo in product(*self.index):
            yield self.name.format(*combo)


@dataclass(frozen=True)
class BufferPlan:
    """The buffers of one run (module docstring). Entries naming the same buffers are one (the larger)."""

    entries: tuple[BufferSpec, ...] = ()

    def __add__(self, other: BufferPlan) -> BufferPlan:
        return BufferPlan(merged((*self.entries, *other.entries)))

    def bytes_on(self) -> dict[str, int]:
        """Bytes per tier."""
        on = {"gpu": 0, "cpu": 0, "disk": 0}
        for spec in self.entries:
            on[spec.tier] += spec.total
        return on

    def buffers(self) -> dict[str, BufferSpec]:
        """Every buffer by name (a name two entries give keeps the larger)."""
        out: dict[str, BufferSpec] = {}
        for spec in self.entries:
            one = BufferSpec(spec.name, spec.tier, spec.shape, spec.dtype, spec.owner, spec.quant)
            for name in spec.names():
                held = out.get(name)
                if held is None or held.nbytes < one.nbytes:
                    out[name] = BufferSpec(name, one.tier, one.shape, one.dtype, one.owner, one.quant)
        return out


def merged(entries: Sequence[BufferSpec]) -> tuple[BufferSpec, ...]:
    """`entries` with every buffer in one entry, the largest: entries of one name and index reduced to the
    largest, and entries of one name template whose buffers overlap (a buffer several GPU batches of unlike
    shapes share) split into one entry per buffer."""
    by_name: dict[str, dict[tuple, BufferSpec]] = {}
    for spec in entries:
        same = by_name.setdefault(spec.name, {})
        if spec.index not in same or same[spec.index].nbytes < spec.nbytes:
            same[spec.index] = spec
    out: list[BufferSpec] = []
    for specs in by_name.values():
        group = list(specs.values())
        if not any(_overlap(a, b) for n, a in enumerate(group) for b in group[n + 1:]):
            out += group
            continue
        one: dict[str, BufferSpec] = {}
        for spec in group:
            for name in spec.names():
                if name not in one or one[name].nbytes < spec.nbytes:
                    one[name] = BufferSpec(name, spec.tier, spec.shape, spec.dtype, spec.owner, spec.quant)
        out += one.values()
    return tuple(out)


def _overlap(a: BufferSpec, b: BufferSpec) -> bool:
    """Whether entries `a` and `b` of one name template name a buffer in common."""
    return len(a.index) == len(b.index) and all(set(x) & set(y) for x, y in zip(a.index, b.index))


@dataclass(frozen=True)
class BatchShape:
    """One GPU batch of a block: rows, padded prompt positions, cache positions S and the shared prefix
    it computes once (`engine.runtime.batch.GpuBatch`: size, prompt_len, length, prefix_len)."""

    rows: int
    prompt_len: int
    length: int
    prefix_len: int = 0


@dataclass(frozen=True)
class BlockShape:
    """A block's GPU batches and its steps (its longest row's new tokens); `first` 1 when its prefill ran
    ahead (its steps are [1, steps))."""

    batches: tuple[BatchShape, ...]
    steps: int
    first: int = 0


def uniform_block(policy: Policy, prompt_len: int, gen_len: int, prefix_len: int = 0) -> BlockShape:
    """The memory model's block: `num_gpu_batches` batches of `gpu_batch_size` rows of `prompt_len` tokens,
    `prefix_len` of them computed once, generating `gen_len` tokens."""
    batch = BatchShape(policy.gpu_batch_size, prompt_len, prompt_len + gen_len - 1, prefix_len)
    return BlockShape((batch,) * policy.num_gpu_batches, gen_len)
