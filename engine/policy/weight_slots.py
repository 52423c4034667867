"""Which device buffer slot holds each streamed layer's weights.

A layer whose weights are not resident on the device is copied into buffers named by its kind and a slot
(`wbuf{slot}.{kind}.{name}`). The schedule issues the load of flat position P = i * J + j in the slots of
P - 1 (`engine.runtime.schedule`), so a buffer is safe while the previous layer that used it is at most P - 2
back: one slot per kind where its layers are never adjacent (alternating attention and MLP, embed and head),
two (alternating by the kind's running occurrence count) where they can be (a step of one layer, a
pipeline stage holding one kind twice in a row).

When a buffer is free again is `engine.runtime.weight_homes`' business: a 4-bit buffer once its dequantization
into the compute's dense copy has run (so the next layer of the kind streams in while this one's GEMMs run),
a dense one once every compute issued before its load has run.

A kind with one layer per step (the embedding, the head) would stream into buffers of its own size, which no
other layer shares: on an accelerator such a kind is held whole on the device instead (`held_whole`), for
the same device memory, less host memory and no copy per step.

A MoE model's compressed expert layers are loaded a layer of their kind ahead (`streamed_ahead`; the MoE
schedule issues the load of position P in the first slot of the previous expert layer, after its compute,
`engine.runtime.moe_schedule`). Their compressed tensors keep one buffer, free once the previous layer's
dequantization has run (as above); their dense tensors (norms, the router), read by that layer's computes
still queued, alternate over two slots (`WeightSlots(ahead=...)`; a few KiB a layer).
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence


def held_whole(kinds: Sequence[str], device_type: str) -> frozenset[str]:
    """The layer kinds whose weights live on the device whatever the policy's weight fractions: on CUDA,
    every kind with one layer among `kinds` (an executor's specs, in order) when there are several layers,
    so its one buffer slot would be as large as its home. Elsewhere none (the cpu tier is compute memory)."""
    if device_type != "cuda" or len(kinds) < 2:
        return frozenset()
    counts = Counter(kinds)
    return frozenset(kind for kind, n in counts.items() if n == 1)


def kind_fractions(kind: str, held: frozenset[str], w_gpu: float, w_cpu: float) -> tuple[float, float]:
    """The (gpu, cpu) fractions `placement.weight_tiers` places a layer of `kind` by: the policy's,
    or all on the gpu for a kind `held_whole` holds."""
    return (1.0, 0.0) if kind in held else (w_gpu, w_cpu)


def kind_gap(kinds: Sequence[str], kind: str) -> int:
    """The fewest flat positions between two consecutive layers of `kind` among `kinds` (across steps too)."""
    J = len(kinds)
    ps = [i * J + j for i in range(2) for j, k in enumerate(kinds) if k == kind]
    return min(b - a for a, b in zip(ps, ps[1:]))


def streamed_ahead(kinds: Sequence[str], is_moe: bool, experts_packed: bool) -> frozenset[str]:
    """The layer kinds whose loads the MoE schedule issues a layer of their kind ahead: a MoE model's "mlp"
    (the experts, nearly all its weight bytes) where its layers alternate with others (`kinds`: an executor's
    specs, in order) and every quantizable weight of theirs is held 4-bit (`experts_packed`: a dense expert
    is read by the GEMMs from its buffer, which would then need a second copy as large); none otherwise."""
    if not is_moe or "mlp" not in kinds or kind_gap(kinds, "mlp") < 2 or not experts_packed:
        return frozenset()
    return frozenset({"mlp"})


class WeightSlots:
    """The slot rule for one executor's layer kinds (`kinds[j]` of its specs, in order); the kinds in `ahead`
    (`streamed_ahead`) are loaded while the previous layer of their kind is in use, so they take two slots
    (for their dense tensors: their compressed ones have one buffer, `engine.runtime.weight_homes`)."""

    def __init__(self, kinds: Sequence[str], ahead: frozenset[str] = frozenset()):
        self.kinds = tuple(kinds)
        self.ahead = ahead
        counts = Counter(self.kinds)
        self._count = [counts[kind] for kind in self.kinds]
        seen: Counter = Counter()
        self._ordinal = []
        for kind in self.kinds:
            self._ordinal.append(seen[kind])
            seen[kind] += 1
        self.slots = {kind: 1 if kind_gap(self.kinds, kind) >= 2 and kind not in ahead else 2 for kind in counts}

    def slot(self, i: int, j: int) -> int:
        """The buffer slot of layer j's weights at step i."""
        return (i * self._count[j] + self._ordinal[j]) % self.slots[self.kinds[j]]

    def slot_set(self, js: Sequence[int], steps: Sequence[int] = (0, 1)) -> tuple[int, ...]:
        """The slots layers `js` use over the steps `steps` (`step_parities`: two consecutive steps cover
        every parity)."""
        return tuple(sorted({self.slot(i, j) for i in steps for j in js}))


def step_parities(first: int, num_steps: int) -> tuple[int, ...]:
    """Representatives of the steps [first, num_steps) for a rule periodic in the step with period 2 (weight
    and cache buffer slots): at most two consecutive steps, as few as the range holds."""
    return tuple(range(first, min(num_steps, first + 2)))
