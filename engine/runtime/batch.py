"""One GPU batch of a block: left-padded prompts, positions, key validity and which rows are alive.

Rows are block-row ids (indices into the prompts given to `generate_block`). The batch's shared prefix
(the longest run of leading tokens common to every row, e.g. a system prompt or few-shot examples; used
when at least `min_prefix` tokens) is computed once for the batch, at cache positions [0, L); each row's
remaining suffix is left-padded to the longest suffix P', at [L, L + P'). Cache slot x holds real
position x - pad(row) past the prefix, so RoPE/learned positions are exact and the pads are masked out.
The KV cache has S = L + P' + max(max_new_tokens) - 1 positions (the last generated token is never fed
back). `t` is the number of cache positions written so far. Finished rows stay in the
tensors (ignored) until `compact` drops them, so a finished sequence stops costing compute.
"""
from __future__ import annotations

import torch

_COMPACT_FRACTION = 0.125


class GpuBatch:
    def __init__(self, rows: list[int], prompts: list[list[int]], max_new: list[int], device: torch.device,
                 pad_id: int = 0, min_prefix: int = 0):
        self.rows = list(rows)
        self.max_new = list(max_new)
        self.generated = [0] * len(rows)
        self.live = [True] * len(rows)
        self.device = device
        L = shared_prefix_len(prompts) if len(prompts) > 1 and min_prefix > 0 else 0
        L = L if L >= min_prefix else 0
        self.prefix_len = L
        self.prefix_ids = torch.tensor([prompts[0][:L]], dtype=torch.int64, device=device)     # [1, L]
        self.prefix_positions = torch.arange(L, device=device)[None, :]                         # [1, L]
        suffixes = [p[L:] for p in prompts]
        P = max(len(p) for p in suffixes)
        self.prompt_len = L + P
        self.length = L + P + max(max_new) - 1
        b = len(rows)
        pads = torch.tensor([P - len(p) for p in suffixes], dtype=torch.int64)                 # [b]
        ids = torch.full((b, P), pad_id, dtype=torch.int64)
        for r, p in enumerate(suffixes):
            ids[r, P - len(p):] = torch.tensor(p, dtype=torch.int64)
        self.pads = pads.to(device)
        self.pads_host = pads.tolist()                                                          # [b] ints
        self.input_ids = ids.to(device)                                                         # [b, P]
        self.positions = (L + torch.arange(P)[None, :] - pads[:, None]).clamp_(min=L).to(device)  # [b, P]
        slot = torch.arange(self.length)[None, :]                                               # [1, S]
        valid = (slot < L) | (slot >= L + pads[:, None])                                       # [b, S]
        self.key_valid_host = valid
        self.key_valid = valid.to(device)
        self.t = 0

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def done(self) -> bool:
        return not any(self.live)

    @property
    def prefill(self) -> bool:
        return self.t == 0

    def common_pad(self, r0: int, r1: int) -> int:
        """The leading pad positions every row of [r0, r1) has (the suffix columns a prefill chunk of those rows
        can skip: they hold no row's token; rows sorted by length share most of them)."""
        return min(self.pads_host[r0:r1])

    def live_index(self) -> list[int]:
        return [r for r, alive in enumerate(self.live) if alive]

    def advance(self, s: int) -> None:
        """Record that s positions were written to the cache by this step."""
        self.t += s

    def set_next(self, picked: dict[int, int]) -> None:
        """Feed `picked` (batch index -> token) next step; positions move past the current cache end."""
        tokens = torch.zeros(self.size, 1, dtype=torch.int64)
        if picked:                                           # one indexed write, not a Python loop over rows
            tokens[torch.tensor(list(picked)), 0] = torch.tensor(list(picked.values()), dtype=torch.int64)
        self.input_ids = tokens.to(self.device)                                                 # [b, 1]
        self.positions = (self.t - self.pads)[:, None]                                          # [b, 1]
        self.prefix_ids = self.prefix_ids[:, :0]

    def finish(self, r: int) -> None:
        self.live[r] = False

    def compact_index(self) -> torch.Tensor | None:
        """Indices of the rows to keep when enough rows finished to be worth a compaction, else None."""
        dead = self.size - sum(self.live)
        if dead == 0 or (dead < self.size * _COMPACT_FRACTION and dead < self.size):
            return None
        return torch.tensor(self.live_index(), dtype=torch.int64)

    def compact(self, keep: torch.Tensor) -> None:
        """Drop every row not in `keep` from this batch's bookkeeping (caches are compacted by their owners)."""
        idx = keep.tolist()
        self.rows = [self.rows[r] for r in idx]
        self.max_new = [self.max_new[r] for r in idx]
        self.generated = [self.generated[r] for r in idx]
        self.live = [self.live[r] for r in idx]
        dev_keep = keep.to(self.device)
        self.pads = self.pads.index_select(0, dev_keep)
        self.pads_host = [self.pads_host[r] for r in idx]
        self.input_ids = self.input_ids.index_select(0, dev_keep)
        self.positions = self.positions.index_select(0, dev_keep)
        self.key_valid = self.key_valid.index_select(0, dev_keep)
        self.key_valid_host = self.key_valid_host.index_select(0, keep)


def shared_prefix_len(prompts: list[list[int]]) -> int:
    """Length of the common leading run of all prompts, leaving at least one own token per prompt."""
    first = prompts[0]
    n = min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        m = 0
        while m < n and p[m] == first[m]:
            m += 1
        n = m
    return max(n, 0)
