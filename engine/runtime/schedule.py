"""FlexGen's block schedule (Algorithm 1, zig-zag over a block) as a torch-free iterator of actions.

Indices, defined once: i = generation step (0 is the prefill), j = layer in `family.layer_specs()` order,
k = GPU batch within the block. Compute slots run in the order (i, j, k) with k fastest: a layer's weights
are loaded once and reused by every GPU batch of the block. Within the slot of (i, j, k) the actions are:

    load_weight   page k of the next layer's weights (all pages at once when not paged)
    store_cache   (i, j, k) of the previous slot          store_hidden  of the previous slot
    load_cache    of the next slot                         load_hidden   of the next slot
    compute       (i, j, k)
    sync          wait for everything issued in this slot

A hidden load of slot n+1 depends on the hidden store of the slot that produced it (n+1-K); with K <= 2 that
store is issued in the same slot or later, so the load is issued just before its compute instead. Paged
weights (MoE-Lightning's CGOPipe) cut the next layer's weight transfer into K pages, one per GPU batch, so
small urgent transfers never wait behind a whole layer.
"""
from __future__ import annotations

from typing import Iterator, Literal, NamedTuple

Verb = Literal["load_weight", "load_cache", "load_hidden", "store_cache", "store_hidden", "compute", "sync",
               "join_attention"]   # join_attention: the MoE schedule's (engine.runtime.moe_schedule)


class Action(NamedTuple):
    """One schedule step (immutable; a NamedTuple because a block issues tens of thousands of them)."""

    verb: Verb
    i: int
    j: int
    k: int
    page: int = 0        # load_weight only: which page of `pages`
    pages: int = 1


def slots(num_steps: int, num_layers: int, num_batches: int, first: int = 0) -> Iterator[tuple[int, int, int]]:
    """The compute order (i, j, k) of the naive nested loop, steps [first, num_steps)."""
    for i in range(first, num_steps):
        for j in range(num_layers):
            for k in range(num_batches):
                yield i, j, k


def block_schedule(num_steps: int, num_layers: int, num_batches: int, *, paged: bool = True,
                   first: int = 0) -> Iterator[Action]:
    """Every action for a block's steps [first, num_steps), in issue order (first = 1: a block whose prefill
    ran ahead, `engine.runtime.ahead`). Each (i, j, k) is computed exactly once, after its loads."""
    K = num_batches
    order = list(slots(num_steps, num_layers, num_batches, first))
    pages = K if paged else 1
    if not order:
        return
    yield from (Action("load_weight", first, 0, 0, p, pages) for p in range(pages))
    yield Action("load_cache", *order[0])
    yield Action("load_hidden", *order[0])
    yield Action("sync", *order[0])
    for n, (i, j, k) in enumerate(order):
        nxt = order[n + 1] if n + 1 < len(order) else None
        if j + 1 < num_layers:
            wi, wj = i, j + 1
        else:
            wi, wj = i + 1, 0
        if wi < num_steps and (paged or k == 0):
            if paged:
                yield Action("load_weight", wi, wj, k, k, pages)
            else:
                yield Action("load_weight", wi, wj, 0, 0, 1)
        if n > 0:
            yield Action("store_cache", *order[n - 1])
            yield Action("store_hidden", *order[n - 1])
        if nxt is not None:
            yield Action("load_cache", *nxt)
            if K > 2:
                yield Action("load_hidden", *nxt)
        if n > 0 and K <= 2:
            yield Action("load_hidden", i, j, k)
        yield Action("compute", i, j, k)
        yield Action("sync", i, j, k)
    last = order[-1]
    yield Action("store_cache", *last)
    yield Action("store_hidden", *last)
    yield Action("sync", *last)
