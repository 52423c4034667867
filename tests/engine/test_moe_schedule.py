"""The MoE schedule (CGOPipe over the zig-zag): coverage, page order, join order, weight-buffer hazards
(torch-free)."""
from __future__ import annotations

import pytest

from engine.runtime.moe_schedule import moe_block_schedule, previous_of_kind
from engine.runtime.schedule import block_schedule, slots


def kinds_of(decoder_layers: int) -> list[str]:
    return ["embed", *(["attention", "mlp"] * decoder_layers), "head"]


LOADS = ("load_weight", "prefetch_weight")


def positions(actions):
    """{(verb, i, j, k) or, for a load (either verb), ("load_weight", i, j, page): its first index}."""
    pos = {}
    for n, a in enumerate(actions):
        key = (a.verb, a.i, a.j, a.k) if a.verb not in LOADS else ("load_weight", a.i, a.j, a.page)
        assert key not in pos or a.verb == "sync", f"{key} issued twice"
        pos.setdefault(key, n)
    return pos


@pytest.mark.parametrize("steps,layers,batches,pages", [(1, 1, 1, 1), (3, 2, 1, 4), (3, 2, 2, 1), (2, 3, 3, 3),
                                                         (3, 2, 4, 2), (2, 2, 2, 7)])
@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("ahead", [frozenset(), frozenset({"mlp"})], ids=["", "ahead"])
def test_covers_and_respects_dependencies(steps, layers, batches, pages, pipelined, ahead):
    kinds = kinds_of(layers)
    actions = list(moe_block_schedule(steps, kinds, batches, pages=pages, pipelined=pipelined, ahead=ahead))
    J = len(kinds)
    assert [(a.i, a.j, a.k) for a in actions if a.verb == "compute"] == list(slots(steps, J, batches))
    pos = positions(actions)
    base = [a for a in block_schedule(steps, J, batches, paged=False) if a.verb not in ("load_weight", "compute")]
    assert [a for a in actions if a.verb not in (*LOADS, "compute", "join_attention")] == base
    for (i, j, k) in slots(steps, J, batches):
        for p in range(pages):
            assert pos[("load_weight", i, j, p)] < pos[("compute", i, j, k)]     # every page before compute
    for a in actions:
        if a.verb in LOADS:
            assert a.pages == pages
    assert any(a.verb == "prefetch_weight" for a in actions) == bool(ahead and steps * layers > 1)


@pytest.mark.parametrize("batches,pages", [(1, 1), (2, 2), (3, 4)])
@pytest.mark.parametrize("pipelined", [True, False])
def test_experts_load_at_the_first_slot_of_the_previous_expert_layer(batches, pages, pipelined):
    """With `ahead`, every expert layer but the block's first is loaded whole (`prefetch_weight`, which no
    slot's sync waits for) right after the first compute of the previous expert layer (which dequantizes that
    layer out of the buffer they share), after the whole load of the attention layer in between (queued behind
    it otherwise); with pipelined host attention (decode) after that layer's deferred load, at the last slot.
    The first is loaded as before, in pages over the slots of the layer before it."""
    kinds, steps = kinds_of(3), 3
    actions = list(moe_block_schedule(steps, kinds, batches, pages=pages, pipelined=pipelined,
                                      ahead=frozenset({"mlp"})))
    experts = [(i, j) for i in range(steps) for j, kind in enumerate(kinds) if kind == "mlp"]
    first_compute = {}
    for n, a in enumerate(actions):
        if a.verb == "compute":
            first_compute.setdefault((a.i, a.j), n)
    assert not any(a.verb == "prefetch_weight" and (a.i, a.j) == experts[0] for a in actions)
    for (pi, pj), (i, j) in zip(experts, experts[1:]):
        issued = [n for n, a in enumerate(actions) if a.verb == "prefetch_weight" and (a.i, a.j) == (i, j)]
        assert len(issued) == pages and issued == list(range(issued[0], issued[0] + pages))
        assert not any(a.verb == "load_weight" and (a.i, a.j) == (i, j) for a in actions)
        start = issued[0]
        previous_slots = [n for n, a in enumerate(actions) if a.verb == "compute" and (a.i, a.j) == (pi, pj)]
        assert previous_slots[0] < start < first_compute[(pi, pj + 1)]  # within the previous expert layer
        if not (pipelined and pi >= 1):                                 # pipelined: after the deferred loads
            assert start == previous_slots[0] + 1
        between = [n for n, a in enumerate(actions) if a.verb == "load_weight" and (a.i, a.j) == (pi, pj + 1)]
        assert between and max(between) < start                        # the attention layer's load first


def test_weights_of_the_first_expert_layer_of_a_block_ahead_are_loaded_as_before():
    kinds = kinds_of(2)
    plain = list(moe_block_schedule(3, kinds, 2, pages=2, pipelined=False, first=1))
    ahead = list(moe_block_schedule(3, kinds, 2, pages=2, pipelined=False, first=1, ahead=frozenset({"mlp"})))
    load = [a for a in plain if a.verb == "load_weight" and (a.i, a.j) == (1, 2)]
    assert load and load == [a for a in ahead if a.verb == "load_weight" and (a.i, a.j) == (1, 2)]


@pytest.mark.parametrize("batches,pages", [(2, 2), (4, 8), (3, 1)])
def test_pages_spread_over_the_previous_layers_slots(batches, pages):
    """Pages of layer j+1 go out ceil-evenly at the starts of layer j's slots, the first with slot 0."""
    kinds = kinds_of(2)
    actions = list(moe_block_schedule(1, kinds, batches, pages=pages, pipelined=True))
    issued = [(a.page, a.k) for a in actions if a.verb == "load_weight" and a.j == 2]
    assert [p for p, _ in issued] == list(range(pages))
    per_slot = [sum(1 for _, k in issued if k == s) for s in range(batches)]
    assert per_slot[0] >= 1 and sum(per_slot) == pages and max(per_slot) - min(per_slot) <= 1 + (pages < batches)
    for n, a in enumerate(actions):                    # a page is issued before anything else of its slot
        if a.verb == "load_weight" and a.j == 2:
            assert actions[n - 1].verb in ("sync", "load_weight")


@pytest.mark.parametrize("batches", [1, 2, 4])
def test_joins_overlap_host_attention_with_experts(batches):
    """Each decode attention (i, j, k) is joined once, after its compute and before the MoE compute of
    (i, j+1, k); the host attends k while the device computes the MoE layer of every batch before k."""
    kinds = kinds_of(2)
    steps = 3
    actions = list(moe_block_schedule(steps, kinds, batches, pages=2, pipelined=True))
    pos = positions(actions)
    joins = [(a.i, a.j, a.k) for a in actions if a.verb == "join_attention"]
    attn = [j for j, kind in enumerate(kinds) if kind == "attention"]
    assert sorted(joins) == sorted((i, j, k) for i in range(1, steps) for j in attn for k in range(batches))
    for i, j, k in joins:
        start, join = pos[("compute", i, j, k)], pos[("join_attention", i, j, k)]
        assert start < join < pos[("compute", i, j + 1, k)]
        between = {(a.j, a.k) for a in actions[start:join] if a.verb == "compute"}
        assert {(j + 1, m) for m in range(k)} <= between                     # experts of 0..k-1 meanwhile
    assert not any(a.verb == "join_attention" and a.i == 0 for a in actions)   # prefill attends on the device
    assert not any(a.verb == "join_attention" for a in moe_block_schedule(steps, kinds, batches, pages=2,
                                                                          pipelined=False))


@pytest.mark.parametrize("batches", [1, 3])
def test_attention_weights_wait_for_the_last_join(batches):
    """With pipelining, a decode attention layer's weights (its buffer feeds the joins of the attention two
    layers back) are issued only after the last join and compute of the layer in between."""
    kinds = kinds_of(3)
    actions = list(moe_block_schedule(2, kinds, batches, pages=2, pipelined=True))
    pos = positions(actions)
    for j in (3, 5):                                      # attention layers after the first
        first = pos[("load_weight", 1, j, 0)]
        assert first > pos[("compute", 1, j - 1, batches - 1)]
        assert first > pos[("join_attention", 1, j - 2, batches - 1)]
    first_attention = pos[("load_weight", 1, 1, 0)]      # after embed: nothing to join, paged as usual
    assert first_attention < pos[("compute", 1, 0, 0)]


@pytest.mark.parametrize("steps,layers,batches", [(1, 2, 2), (3, 2, 1), (3, 2, 2), (4, 3, 3), (3, 2, 5)])
@pytest.mark.parametrize("pipelined", [True, False])
def test_next_steps_first_cache_loads_cross_the_link_during_the_heads(steps, layers, batches, pipelined):
    """With `early_cache`, the cache loads of each decode step's first attention layer, for its first two GPU
    batches, are issued (`prefetch_cache`) at the first slot of the step before's head, before its compute
    (the heads block the compute thread on the device); every other cache load is `block_schedule`'s. Every
    decode attention (i, j, k) is loaded exactly once, before its compute; the computes keep their order."""
    kinds = kinds_of(layers)
    J = len(kinds)
    actions = list(moe_block_schedule(steps, kinds, batches, pages=2, pipelined=pipelined, early_cache=True))
    assert [(a.i, a.j, a.k) for a in actions if a.verb == "compute"] == list(slots(steps, J, batches))
    pos = positions(actions)
    loads = [(a.i, a.j, a.k) for a in actions if a.verb in ("load_cache", "prefetch_cache")]
    assert len(loads) == len(set(loads))
    attention = [j for j, kind in enumerate(kinds) if kind == "attention"]
    early = {(i, 1, k) for i in range(1, steps) for k in range(min(2, batches))}
    assert {(a.i, a.j, a.k) for a in actions if a.verb == "prefetch_cache"} == early
    for i in range(1, steps):
        for j in attention:
            for k in range(batches):
                verb = "prefetch_cache" if (i, j, k) in early else "load_cache"
                assert pos[(verb, i, j, k)] < pos[("compute", i, j, k)]
    for i, j, k in early:
        assert pos[("compute", i - 1, J - 2, batches - 1)] < pos[("prefetch_cache", i, j, k)] \
            < pos[("compute", i - 1, J - 1, 0)]                             # the last experts, then the heads
    plain = list(moe_block_schedule(steps, kinds, batches, pages=2, pipelined=pipelined))
    assert not any(a.verb == "prefetch_cache" for a in plain)
    assert sorted(loads) == sorted((a.i, a.j, a.k) for a in plain if a.verb == "load_cache")


def test_previous_of_kind_crosses_steps():
    kinds = kinds_of(2)                                   # embed, attention, mlp, attention, mlp, head
    assert previous_of_kind(kinds, 0, 4) == (0, 2)
    assert previous_of_kind(kinds, 1, 2) == (0, 4)
    assert previous_of_kind(kinds, 1, 1) == (0, 3)


def test_bad_pages():
    with pytest.raises(ValueError, match="pages must be >= 1"):
        list(moe_block_schedule(1, kinds_of(1), 1, pages=0, pipelined=True))


@pytest.mark.parametrize("layers,batches,pages", [(1, 1, 1), (3, 1, 2), (3, 2, 2), (2, 3, 5), (3, 4, 4)])
@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("ahead", [False, True], ids=["", "ahead"])
def test_weight_pages_never_overwrite_a_buffer_in_use(layers, batches, pages, pipelined, ahead):
    """With the executor's buffer slots (`WeightSlots`), every page of a layer's load lands in its (kind, slot)
    buffer only after every compute and every join (which reads the attention layer's weights) of the layer
    held there before it has been issued; each compute and join reads its own layer's weights. Loaded ahead,
    the experts' compressed tensors share one buffer, which only a layer's first compute reads (it
    dequantizes them): a load lands there after the first compute of the layer held there before it."""
    from engine.policy.weight_slots import WeightSlots

    kinds = kinds_of(layers)
    early = frozenset({"mlp"}) if ahead else frozenset()
    rule = WeightSlots(kinds, early)
    assert rule.slots["mlp"] == (2 if ahead else 1)
    held: dict[tuple[str, int], tuple[int, int]] = {}
    packed: dict[str, tuple[int, int]] = {}              # an ahead kind's one compressed buffer: its layer
    reads: dict[tuple[int, int], int] = {}
    needs: dict[tuple[int, int], int] = {}
    for a in moe_block_schedule(3, kinds, batches, pages=pages, pipelined=pipelined, ahead=early):
        layer, buffer, kind = (a.i, a.j), (kinds[a.j], rule.slot(a.i, a.j)), kinds[a.j]
        if a.verb in ("compute", "join_attention"):
            assert held.get(buffer) == layer, f"{a} reads {held.get(buffer)}'s weights"
            if kind in early and layer not in reads:
                assert packed.get(kind) == layer, f"{a} dequantizes {packed.get(kind)}'s experts"
            reads[layer] = reads.get(layer, 0) + 1
            needs[layer] = batches * (2 if pipelined and a.i >= 1 and kinds[a.j] == "attention" and a.j >= 1 else 1)
        elif a.verb in LOADS:
            previous = held.get(buffer)
            if previous is not None and previous != layer:
                assert reads.get(previous, 0) == needs[previous], f"page {a.page} of {layer} overwrites {previous}"
            held[buffer] = layer
            if kind in early:
                previous = packed.get(kind)
                if previous is not None and previous != layer:
                    assert reads.get(previous, 0) >= 1, f"page {a.page} of {layer} overwrites {previous}'s experts"
                packed[kind] = layer
