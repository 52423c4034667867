"""The contract between the executor (runs forwards) and the decoding controller (picks tokens).

The executor knows nothing of sampling, stop strings or grammars: after each forward of a GPU batch it
hands the last-position logits of that batch's alive sequences to a `TokenSelector`, which returns the
next token of each and whether it is finished. A finished sequence stops costing compute.

A selector may also define `end_step()`: the executor calls it once every GPU batch of a step has chosen
(`end_step`), so work the selector starts for the next step (a grammar's next masks) runs beside the
device's next step rather than beside the other batches' choices on the host.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from engine.decoding.sampling import greedy


class TokenSelector(Protocol):
    def __call__(self, rows: Sequence[int], logits: torch.Tensor) -> tuple[list[int], list[bool]]:
        """Choose the next token for each alive sequence of one GPU batch.

        rows: block-row ids (indices into the `prompts` list given to `Executor.generate_block`) of the
        alive sequences, in the order of `logits`' rows. logits: [len(rows), vocab] on any device, in the dtype
        the model's head gives (`ModelFamily.head`: the model's dtype, or float32).
        Returns (token_ids, finished), one entry per row. A finished row's token is still part of its
        output (the selector records it); the executor never feeds a finished row again.
        """


def end_step(select: TokenSelector) -> None:
    """Call the selector's `end_step` hook, when it has one."""
    hook = getattr(select, "end_step", None)
    if hook is not None:
        hook()


class GreedyToEnd:
    """A `TokenSelector` for trials and benchmarks: greedy argmax, never finishes a row (every row runs to its
    own max_new_tokens, as FlexGen measures throughput); `tokens` counts the tokens chosen."""

    def __init__(self) -> None:
        self.tokens = 0

    def __call__(self, rows: Sequence[int], logits: torch.Tensor) -> tuple[list[int], list[bool]]:
        self.tokens += len(rows)
        return greedy(logits).tolist(), [False] * len(rows)
