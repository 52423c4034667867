"""The MoE block schedule (MoE-Lightning's CGOPipe over FlexGen's zig-zag) as a torch-free iterator of actions.

Indices as in `engine.runtime.schedule`: i step (0 = prefill), j layer in `family.layer_specs()` order, k GPU
batch; a GPU batch is CGOPipe's micro-batch. The compute order is `block_schedule`'s, (i, j, k) with k fastest
(the prefill's layers snaking through the GPU batches);
what changes is when weights move and when host attention is joined:

  - paged weights: the next layer's weight transfer is cut into `pages` pages (slices of dim 0 of every
    tensor: for stacked experts, whole experts), issued ceil-evenly over the K slots of the current layer,
    each at the start of its slot, so a small urgent transfer is never stuck behind a whole layer;
  - pipelined host attention (`pipelined`, decode steps i >= 1): the compute of a decode attention layer
    (j, k) only starts it (q/k/v to the host, attention on a host thread); `join_attention` (i, j, k), just
    before the compute of the MoE layer (i, j + 1, k), waits for it and finishes the attention layer
    (output projection, residual). So the host attends GPU batch k while the device runs the router and
    experts of batches 0..k-1 (and the q/k/v projections of k+1..K-1);
  - an attention layer whose predecessor's GPU batches hold unjoined attention outputs (decode, the layer
    two back is attention) moves its weights only after the last compute of that predecessor: its buffer
    still feeds the joins until then. Attention weights are a few percent of a MoE layer.

  - layers loaded ahead (`ahead`: compressed expert layers, `engine.policy.weight_slots.streamed_ahead`): the
    load of such a layer is issued in the first slot of the previous layer of its kind, right after that
    slot's compute (which dequantizes the previous layer's experts out of the one buffer they share,
    `engine.runtime.weight_homes`), as `prefetch_weight` actions, which the executor waits for at the
    layer's own compute only, never at a slot's sync; the layer in between (attention) is then loaded whole
    at the start of that slot, ahead of the experts on the weight stream (its pages spread over the slots
    would queue behind them), or, deferred (pipelined host attention), at the last slot's sync, the experts
    right after it. Issued in the slots of the layer before it instead, the experts' transfer overlaps only
    the attention layer's compute and the experts' compute only the attention weights' small transfer: over 7
    decode steps of Mixtral-8x7B cut to 4 layers at 256x2, half its weights streamed (H200, a trace read by
    `benchmarks/profiling/timeline.py`), the link is busy 0.40 s and the compute stream 0.18 s, yet the steps take
    0.69 s: the two overlap for under 0.07 s. Loaded ahead, the same cut's decode step takes 0.0626 s instead
    of 0.0670 s (H100, an A/B of the two orders in one run). The block's first expert layer (no earlier
    layer of its kind in the block) is paged over the slots of the layer before it.

  - the next step's first cache loads ahead (`early_cache`): the cache loads of the first attention layer of
    step i + 1, for its first two GPU batches (their double-buffer slots differ, and the decodes that last read
    those buffers are issued already), are issued as `prefetch_cache` at the first slot of step i's head,
    before its compute. In `block_schedule`'s order they are issued after step i's heads have picked their
    tokens, which blocks the compute thread on the device, so the link sits idle across every step boundary
    while the heads compute, the host picks tokens and the embeddings run. Like `prefetch_weight`, only the
    load's own compute waits for it, never a slot's sync. A GPU batch that compacts its rows at the head
    loads its prefetched caches again (`Executor._apply_step`).

Everything else (cache and hidden loads/stores, syncs) is `block_schedule`'s, unchanged.
"""
from __future__ import annotations

from typing import Iterator, Sequence

from engine.runtime.schedule import Action, batch_order, block_schedule


def _page_range(k: int, num_batches: int, pages: int) -> range:
    """The pages slot k of num_batches issues: ceil-even shares, so slot 0 always issues one (pages >= 1)."""
    return range(-(-k * pages // num_batches), -(-(k + 1) * pages // num_batches))


def _slots(actions: Iterator[Action]) -> Iterator[list[Action]]:
    """`block_schedule`'s actions cut after every sync: the prologue, one list per compute slot, the epilogue."""
    chunk: list[Action] = []
    for action in actions:
        chunk.append(action)
        if action.verb == "sync":
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _early_loads(num_steps: int, kinds: Sequence[str], first: int, ahead: frozenset[str]
                 ) -> dict[tuple[int, int], tuple[int, int]]:
    """{(i, j): the layer of kind in `ahead` whose load the first slot of (i, j) issues}: each such layer but
    the block's first of its kind, keyed by the previous layer of its kind (steps [first, num_steps))."""
    early, last = {}, {}
    for i in range(first, num_steps):
        for j, kind in enumerate(kinds):
            if kind in ahead:
                if kind in last:
                    early[last[kind]] = (i, j)
                last[kind] = (i, j)
    return early


def previous_of_kind(kinds: Sequence[str], i: int, j: int) -> tuple[int, int]:
    """The layer (step, index) of kind kinds[j] before layer j of step i (in an earlier step if need be; a
    negative step before the first)."""
    J = len(kinds)
    n = i * J + j - 1
    while kinds[n % J] != kinds[j]:
        n -= 1
    return n // J, n % J


def _early_cache(i: int, j: int | None, num_layers: int, num_batches: int) -> list[tuple[int, int, int]]:
    """The cache loads (i + 1, j, k) issued at step i's head: the first attention layer j's (None: the model
    has none) first two GPU batches."""
    if j is None:
        return []
    return [(i + 1, j, k) for k in batch_order(i + 1, j, num_layers, num_batches)[:2]]


def moe_block_schedule(num_steps: int, kinds: Sequence[str], num_batches: int, *, pages: int,
                       pipelined: bool, first: int = 0, ahead: frozenset[str] = frozenset(),
                       early_cache: bool = False) -> Iterator[Action]:
    """Every action for a block of a MoE model whose layer kinds are `kinds` (embed, attention, mlp, ...,
    head), in issue order. Each (i, j, k) is computed once, after its loads; with `pipelined`, each decode
    attention (i, j, k) is joined once, after its compute and before the compute of (i, j + 1, k); the layers
    of the kinds in `ahead` are loaded in the first slot of the previous layer of their kind, after its compute
    (with deferred attention weights, in its last slot, after them); with `early_cache`, the next step's first
    cache loads are issued at the first slot of a step's head, before its compute (`prefetch_cache`). Steps
    [first, num_steps), as `block_schedule`."""
    if pages < 1:
        raise ValueError(f"moe_block_schedule: pages must be >= 1, got {pages}")
    J, K = len(kinds), num_batches
    early = _early_loads(num_steps, kinds, first, ahead)
    prefetched = set(early.values())
    cache_ahead: list[tuple[int, int, int]] = []     # the cache loads issued at the previous step's head
    first_attention = next((j for j, kind in enumerate(kinds) if kind == "attention"), None)

    def deferred(wi: int, wj: int) -> bool:
        return pipelined and wi >= 1 and wj >= 2 and kinds[wj] == "attention" and kinds[wj - 2] == "attention"

    def joins(i: int, j: int) -> bool:
        return pipelined and i >= 1 and j >= 1 and kinds[j] == "mlp" and kinds[j - 1] == "attention"

    target: tuple[int, int] | None = None            # the layer whose weights the current layer's slots load
    for chunk in _slots(block_schedule(num_steps, J, K, paged=False, first=first)):
        compute = next((a for a in chunk if a.verb == "compute"), None)
        if compute is None:                            # prologue (layer 0's weights, whole) or epilogue
            for a in chunk:
                if a.verb == "load_weight":
                    yield from (Action("load_weight", a.i, a.j, 0, p, pages) for p in range(pages))
                else:
                    yield a
            continue
        i, j, k = compute.i, compute.j, compute.k
        place = batch_order(i, j, J, K).index(k)      # the slot's place in its layer (the prefill snakes)
        loads = [a for a in chunk if a.verb == "load_weight"]
        if loads:
            target = (loads[0].i, loads[0].j)
        elif place == 0:
            target = None                              # the last step's last layer: nothing follows
        page_loads = []
        if target is not None and target not in prefetched:
            wi, wj = target
            whole = range(pages) if place == (K - 1 if deferred(wi, wj) else 0) else range(0)
            spread = (i, j) not in early and not deferred(wi, wj)
            page_loads = [Action("load_weight", wi, wj, k, p, pages)
                          for p in (_page_range(place, K, pages) if spread else whole)]
        if early_cache and j == J - 1 and place == 0 and i + 1 < num_steps:
            cache_ahead = _early_cache(i, first_attention, J, K)
            yield from (Action("prefetch_cache", *key) for key in cache_ahead)
        late = target is not None and deferred(*target)
        ahead = []
        if (i, j) in early and place == (K - 1 if late else 0):
            ahead = [Action("prefetch_weight", *early[(i, j)], k, p, pages) for p in range(pages)]
        if not late:
            yield from page_loads
        for a in chunk:
            if a.verb == "load_weight" or (a.verb == "load_cache" and (a.i, a.j, a.k) in cache_ahead):
                continue
            if a.verb == "compute" and joins(i, j):
                yield Action("join_attention", i, j - 1, k)
            if a.verb == "sync" and late:
                yield from page_loads
                yield from ahead
            yield a
            if a.verb == "compute" and not late:
                yield from ahead
