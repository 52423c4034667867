"""The block schedule against the naive loop: coverage and dependencies (torch-free)."""
from __future__ import annotations

import pytest

from engine.policy.weight_slots import WeightSlots
from engine.runtime.schedule import batch_order, block_schedule, slots
from helpers.schedule_checks import assert_weight_loads_wait_for_computes


@pytest.mark.parametrize("steps,layers,batches", [(1, 4, 1), (3, 6, 1), (2, 6, 2), (3, 5, 3), (2, 8, 4)])
@pytest.mark.parametrize("paged", [True, False])
def test_covers_and_respects_dependencies(steps, layers, batches, paged):
    actions = list(block_schedule(steps, layers, batches, paged=paged))
    computes = [(a.i, a.j, a.k) for a in actions if a.verb == "compute"]
    assert computes == list(slots(steps, layers, batches))           # each (i, j, k) once, zig-zag order
    seen = {}
    for n, a in enumerate(actions):
        seen.setdefault((a.verb, a.i, a.j, a.k if a.verb != "load_weight" else a.page), n)
    pages = batches if paged else 1
    previous = None                                                         # the last compute's batch
    for n, a in enumerate(actions):
        if a.verb != "compute":
            continue
        for p in range(pages):
            assert seen[("load_weight", a.i, a.j, p)] < n                   # weights (all pages) before compute
        assert seen[("load_cache", a.i, a.j, a.k)] < n
        if previous != a.k:                                                 # the same batch again: no reload
            assert seen[("load_hidden", a.i, a.j, a.k)] < n
        previous = a.k
        if (a.i, a.j, a.k) != (0, 0, 0):                                   # prefetched cache: a sync in between
            syncs = [m for m in range(seen[("load_cache", a.i, a.j, a.k)], n) if actions[m].verb == "sync"]
            assert syncs
    for a in actions:
        if a.verb in ("store_cache", "store_hidden"):
            assert seen[("compute", a.i, a.j, a.k)] < seen[(a.verb, a.i, a.j, a.k)]


@pytest.mark.parametrize("batches", [1, 2, 3])
def test_hidden_load_after_producer_store(batches):
    steps, layers = 2, 5
    actions = list(block_schedule(steps, layers, batches))
    pos = {}
    for n, a in enumerate(actions):
        pos.setdefault((a.verb, a.i, a.j, a.k), n)
    order = list(slots(steps, layers, batches))
    for m, (i, j, k) in enumerate(order):
        earlier = [n for n in range(m) if order[n][2] == k]
        if not earlier:
            continue
        producer = order[earlier[-1]]                                     # the slot that last computed batch k
        if earlier[-1] == m - 1:                                          # right before: the hidden stays
            assert ("store_hidden", *producer) not in pos and ("load_hidden", i, j, k) not in pos
            continue
        assert pos[("store_hidden", *producer)] < pos[("load_hidden", i, j, k)]
        sync_between = [n for n in range(pos[("store_hidden", *producer)], pos[("load_hidden", i, j, k)])
                        if actions[n].verb == "sync"]
        assert sync_between, "a store and the dependent load must be separated by a sync"


@pytest.mark.parametrize("batches", [1, 2, 3])
def test_the_prefill_snakes_and_keeps_the_last_batch_on_the_device(batches):
    """At the prefill the batch computed last in a layer is computed first in the next, and nothing parks it
    in between; the head and the decode steps run the batches in ascending order; one GPU batch never parks."""
    steps, layers = 3, 6
    order = list(slots(steps, layers, batches))
    for j in range(layers):
        ks = [k for i, jj, k in order if i == 0 and jj == j]
        assert ks == (list(range(batches)) if (layers - 1 - j) % 2 == 0 else list(range(batches))[::-1])
        for i in (1, 2):
            assert [k for ii, jj, k in order if ii == i and jj == j] == list(range(batches))
    assert batch_order(0, layers - 1, layers, batches) == range(batches)      # the head: ascending
    actions = list(block_schedule(steps, layers, batches))
    parked = [(a.i, a.j, a.k) for a in actions if a.verb == "store_hidden"]
    switches = [order[n] for n in range(len(order) - 1) if order[n][2] != order[n + 1][2]]
    assert parked == switches + [order[-1]]                   # one GPU batch: no switch, only the block's end


@pytest.mark.parametrize("batches", [2, 3, 4])
def test_parked_hiddens_load_a_slot_ahead_at_the_prefill_only_past_two_batches(batches):
    """With K > 2 every hidden the prefill parks is loaded before the previous slot's compute is issued, so it
    crosses the link under that compute; with K = 2 each parked hidden is loaded between the previous slot's
    compute and its own (no second prefill hidden on the device during a compute: that would run out of
    memory)."""
    layers = 6
    actions = list(block_schedule(2, layers, batches))
    computes = [n for n, a in enumerate(actions) if a.verb == "compute"]
    pos: dict[tuple, int] = {}
    for n, a in enumerate(actions):
        pos.setdefault((a.verb, a.i, a.j, a.k), n)
    order = list(slots(2, layers, batches))
    switches = [m for m in range(1, len(order)) if order[m][2] != order[m - 1][2]]
    prefill = [m for m in switches if order[m][0] == 0]
    assert len(prefill) == layers * (batches - 1)                        # within layers only: the snake
    for m in prefill:
        load = pos[("load_hidden", *order[m])]
        assert load < computes[m - 1] if batches > 2 else computes[m - 1] < load < computes[m], order[m]


def test_weight_pages_spread_over_batches():
    actions = list(block_schedule(1, 3, 4, paged=True))
    loads = [(a.j, a.page, a.k) for a in actions if a.verb == "load_weight" and a.j == 1]
    assert loads == [(1, p, p) for p in range(4)]                         # page p issued with GPU batch p
    unpaged = [a for a in block_schedule(1, 3, 4, paged=False) if a.verb == "load_weight" and a.j == 1]
    assert len(unpaged) == 1 and unpaged[0].pages == 1


def test_empty_schedule():
    assert list(block_schedule(0, 4, 2)) == []


def _decoder(layers: int) -> list[str]:
    return ["embed", *["attention", "mlp"] * layers, "head"]


@pytest.mark.parametrize("kinds", [_decoder(1), _decoder(3), ["embed", "head"], ["mlp"], ["attention", "mlp"],
                                   ["mlp", "attention", "mlp", "head"], ["attention", "mlp", "mlp", "attention"]])
@pytest.mark.parametrize("batches,paged", [(1, False), (2, True), (3, True), (3, False)])
def test_weight_loads_never_overwrite_a_buffer_in_use(kinds, batches, paged):
    """A load into (kind, slot) is issued only after every compute of the layer loaded there before it has been
    issued (a dense copy waits for the computes issued before it, a 4-bit one for its predecessor's
    dequantization, done by the first of them: `engine.runtime.weight_homes`), and before its own compute."""
    assert_weight_loads_wait_for_computes(block_schedule(3, len(kinds), batches, paged=paged), kinds, batches)


def test_weight_slots_of_a_decoder():
    rule = WeightSlots(_decoder(3))
    assert rule.slots == {"embed": 1, "attention": 1, "mlp": 1, "head": 1}   # never adjacent: one buffer a kind
    assert WeightSlots(["attention", "mlp", "mlp", "attention"]).slots == {"attention": 2, "mlp": 2}
    one = WeightSlots(["mlp"])                                                  # a step of one layer: two
    assert [one.slot(i, 0) for i in range(4)] == [0, 1, 0, 1] and one.slot_set([0]) == (0, 1)
