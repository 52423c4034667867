"""FlexGen's block schedule (Algorithm 1, zig-zag over a block) as a torch-free iterator of actions.

Indices, defined once: i = generation step (0 is the prefill), j = layer in `family.layer_specs()` order,
k = GPU batch within the block. Compute slots run in the order (i, j, k) with k fastest: a layer's weights
are loaded once and reused by every GPU batch of the block. Within the slot of (i, j, k) the actions are:

    load_weight   page k of the next layer's weights (all pages at once when not paged)
    store_cache   (i, j, k) of the previous slot          store_hidden  of the previous slot
    load_cache    of the next slot                         load_hidden   of the next slot
    compute       (i, j, k)
    sync          wait for everything issued in this slot

At the prefill (i = 0) the GPU batches of every other layer run in reverse (`batch_order`, a snake counted
from the last layer, so the head runs them in ascending order): the batch computed last in a layer is
computed first in the next, its hidden stays on the device (no store or load between those two slots), and
every other batch's parked hidden has two computes to cover its round trip. In FlexGen's order each parked
hidden has one: Mixtral-8x7B at 1024x2 with the hidden states on the host, H100, the device waits ~14 ms
at every (attention, MoE) boundary for a 646 MB hidden to come back (~23% of the prefill).
Decode steps keep the ascending order (their hidden states are never parked; the MoE schedule joins host
attention in that order).

A hidden load depends on the store of the slot that last computed its batch. With K > 2 it is issued a slot
ahead, so it crosses the link during the previous slot's compute (that store was issued a slot earlier still:
with more than two batches no batch comes back the slot after it was parked), and the memory model counts the
second prefill hidden it puts on the device (`engine.policy.memory`, `_untracked_terms`). With K <= 2 it is
issued just before its own compute: loaded a slot ahead there too, it would hold a second prefill hidden on
the device for a whole compute, which takes Mixtral-8x7B at prompt 512 / gen 32 / 16 GiB (256x2, cache on the
device, hidden states on the host) out of memory on an H100, for little gain at K = 2 (the prefill's
compute-stream gaps 0.41 instead of 0.90 s of a 93 s run at prompt 512 / gen 128, none at prompt 77).

Paged weights (MoE-Lightning's CGOPipe) cut the next layer's weight transfer into K pages, one per slot of the
current layer, so small urgent transfers never wait behind a whole layer.
"""
from __future__ import annotations

from typing import Iterator, Literal, NamedTuple

Verb = Literal["load_weight", "load_cache", "load_hidden", "store_cache", "store_hidden", "compute", "sync",
               "join_attention", "prefetch_weight", "prefetch_cache"]   # the last three: the MoE schedule's
                                                                        # (engine.runtime.moe_schedule)


class Action(NamedTuple):
    """One schedule step (immutable; a NamedTuple because a block issues tens of thousands of them)."""

    verb: Verb
    i: int
    j: int
    k: int
    page: int = 0        # load_weight and prefetch_weight only: which page of `pages`
    pages: int = 1


def batch_order(i: int, j: int, num_layers: int, num_batches: int) -> range:
    """The GPU batches of layer j at step i in compute order: descending at the prefill's layers an odd
    number of layers before the last, else ascending (module docstring)."""
    if i == 0 and (num_layers - 1 - j) % 2:
        return range(num_batches - 1, -1, -1)
    return range(num_batches)


def slots(num_steps: int, num_layers: int, num_batches: int, first: int = 0) -> Iterator[tuple[int, int, int]]:
    """The compute order (i, j, k), steps [first, num_steps): the nested loop, GPU batches in `batch_order`."""
    for i in range(first, num_steps):
        for j in range(num_layers):
            for k in batch_order(i, j, num_layers, num_batches):
                yield i, j, k


def _parked(order: list[tuple[int, int, int]], n: int) -> int | None:
    """The GPU batch whose hidden slot n of `order` parks (the previous slot's, when it is another), else None."""
    if n < 1 or order[n - 1][2] == order[n][2]:
        return None
    return order[n - 1][2]


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
        prev = order[n - 1] if n > 0 else None
        nxt = order[n + 1] if n + 1 < len(order) else None
        if j + 1 < num_layers:
            wi, wj = i, j + 1
        else:
            wi, wj = i + 1, 0
        place = batch_order(i, j, num_layers, K).index(k)          # the slot's place in its layer
        if wi < num_steps and (paged or place == 0):
            if paged:
                yield Action("load_weight", wi, wj, k, place, pages)
            else:
                yield Action("load_weight", wi, wj, 0, 0, 1)
        parked = _parked(order, n)
        if prev is not None:
            yield Action("store_cache", *prev)
            if parked is not None:                                # the same batch again: its hidden stays
                yield Action("store_hidden", *prev)
        if nxt is not None:
            yield Action("load_cache", *nxt)
            if K > 2 and nxt[2] != k:                              # a slot ahead (module docstring)
                yield Action("load_hidden", *nxt)
        if K <= 2 and parked is not None:                         # just before its compute
            yield Action("load_hidden", i, j, k)
        yield Action("compute", i, j, k)
        yield Action("sync", i, j, k)
    last = order[-1]
    yield Action("store_cache", *last)
    yield Action("store_hidden", *last)
    yield Action("sync", *last)
