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


def moe_block_schedule(num_steps: int, kinds: Sequence[str], num_batches: int, *, pages: int,
                       pipelined: bool, first: int = 0) -> Iterator[Action]:
    """Every action for a block of a MoE model whose layer kinds are `kinds` (embed, attention, mlp, ...,
    head), in issue order. Each (i, j, k) is computed once, after its loads; with `pipelined`, each decode
    attention (i, j, k) is joined once, after its compute and before the compute of (i, j + 1, k). Steps
    [first, num_steps), as `block_schedule`."""
    if pages < 1:
        raise ValueError(f"moe_block_schedule: pages must be >= 1, got {pages}")
    J, K = len(kinds), num_batches

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
        if target is not None:
            wi, wj = target
            span = range(pages) if place == K - 1 else range(0)
            page_loads = [Action("load_weight", wi, wj, k, p, pages)
                          for p in (span if deferred(wi, wj) else _page_range(place, K, pages))]
        late = target is not None and deferred(*target)
        if not late:
            yield from page_loads
        for a in chunk:
            if a.verb == "load_weight":
                continue
            if a.verb == "compute" and joins(i, j):
                yield Action("join_attention", i, j - 1, k)
            if a.verb == "sync" and late:
                yield from page_loads
            yield a
