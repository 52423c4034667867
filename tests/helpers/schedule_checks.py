"""Checks of weight-buffer use over a block schedule, shared by the schedule and prefill-ahead tests."""
from __future__ import annotations

from collections.abc import Iterable

from engine.policy.weight_slots import WeightSlots
from engine.runtime.schedule import Action


def assert_weight_loads_wait_for_computes(actions: Iterable[Action], kinds: list[str], batches: int) -> None:
    """Over `actions` (a block schedule of layers of `kinds`, `batches` GPU batches): a load into (kind, slot)
    comes only after all `batches` computes of the layer loaded there before it, and every compute finds its
    own layer's weights in its buffer, not a later layer's."""
    rule = WeightSlots(kinds)
    loaded: dict[tuple[str, int], tuple[int, int]] = {}
    computes: dict[tuple[int, int], int] = {}
    for a in actions:
        layer, buffer = (a.i, a.j), (kinds[a.j], rule.slot(a.i, a.j))
        if a.verb == "compute":
            assert loaded.get(buffer) == layer                           # its own weights, not a later layer's
            computes[layer] = computes.get(layer, 0) + 1
        elif a.verb == "load_weight":
            previous = loaded.get(buffer)
            if previous is not None and previous != layer:
                assert computes.get(previous, 0) == batches, f"{kinds}: the load of {layer} overwrites {previous}"
            loaded[buffer] = layer
