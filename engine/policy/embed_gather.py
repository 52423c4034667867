"""Decode steps look up their embedding rows on the host instead of streaming the whole table.

A decode step embeds one token per row, so where the embedding table is not on the GPU the executor copies
just those rows: it gathers them on the host (`index_select` from the pinned or memory-mapped home into a
staging buffer `wgather.embed` (pinned on CUDA) of one block's rows) and sends them into the head of the table's device
buffer, which the prefill filled whole (its prompts' tokens are too many to gather cheaply). For Llama-3-70B
at w_gpu = 0 that is 25 MB instead of the 2.1 GB table per step (on a CPU device, a table on disk is likewise
gathered from its memory map instead of copied whole). Only where the block's rows are a small part
of the vocabulary (`GATHER_RATIO`), so the gathered rows always fit in the buffer and cost less than the table.
"""
from __future__ import annotations

EMBED_TABLE = "embed_tokens.weight"         # the family's token-embedding tensor (its `embed` spec's weight)
GATHER_RATIO = 32                           # gather when the block's rows x this <= the vocabulary


def gathers_embedding(table_moves: bool, block_rows: int, vocab_rows: int) -> bool:
    """Whether decode steps gather the embedding rows on the host: when the dense table is streamed (not read
    in place: off the GPU on CUDA, on disk on a CPU device) and the block's rows are few next to the vocabulary."""
    return table_moves and block_rows * GATHER_RATIO <= vocab_rows


def gather_stage_bytes(block_rows: int, row_elements: int, bytes_per_element: int) -> int:
    """Bytes of the staging buffer `wgather.embed` (pinned on CUDA) [block rows, row elements]."""
    return block_rows * row_elements * bytes_per_element
