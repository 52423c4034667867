"""Prompts and greedy runs through the executor: token selectors that record what they pick, random prompts,
and one block of a policy run to completion."""
from __future__ import annotations

from pathlib import Path

import torch

from engine.policy.policy import Policy
from engine.runtime.executor import Executor


class GreedyRecorder:
    """TokenSelector: argmax; finishes a row when it emits one of `stop_ids`. Records tokens per row."""

    def __init__(self, stop_ids: tuple[int, ...] = ()):
        self.stop_ids = set(stop_ids)
        self.tokens: dict[int, list[int]] = {}
        self.calls = 0

    def __call__(self, rows, logits):
        assert logits.dim() == 2 and logits.shape[0] == len(rows)
        assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16)      # the head's: the model's or float32
        self.calls += 1
        picked = logits.argmax(-1).tolist()
        for r, t in zip(rows, picked):
            self.tokens.setdefault(r, []).append(t)
        return picked, [t in self.stop_ids for t in picked]


class LogitRecorder(GreedyRecorder):
    """GreedyRecorder that also keeps every step's logits per row."""

    def __init__(self):
        super().__init__()
        self.logits: dict[int, list[torch.Tensor]] = {}

    def __call__(self, rows, logits):
        for r, row in zip(rows, logits):
            self.logits.setdefault(r, []).append(row.clone())
        return super().__call__(rows, logits)


class RunToEnd:
    """TokenSelector: argmax, never finishes a row early (every row runs to its max_new)."""

    def __call__(self, rows, logits):
        return logits.argmax(dim=-1).tolist(), [False] * len(rows)


def make_prompts(n: int, vocab: int, seed: int = 1, lo: int = 3, hi: int = 30) -> list[list[int]]:
    """`n` random token prompts (ids 3..vocab-1) of lengths in [lo, hi), sorted by length."""
    g = torch.Generator().manual_seed(seed)
    lens = sorted(torch.randint(lo, hi, (n,), generator=g).tolist())
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


def id_prompts(n: int = 10, seed: int = 0) -> list[list[int]]:
    """Up to 12 random token prompts (ids 3..319, the tiny checkpoints' vocabulary) of mixed lengths, unsorted."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 37, 5, 12, 3, 29, 8, 20, 2, 16, 40, 7][:n]
    return [torch.randint(3, 320, (length,), generator=gen).tolist() for length in lengths]


def run_policy(loaded, policy: Policy, prompts, max_new, *, device="cpu", dtype=torch.float32,
               disk_dir: Path | None = None, stop_ids=(), gpu_memory=None, cpu_memory=None, hook=None):
    """One block of `prompts` under `policy` with a GreedyRecorder: (tokens per row, the closed executor)."""
    ex = Executor(loaded, policy, device=torch.device(device), dtype=dtype, disk_dir=disk_dir,
                  gpu_memory=gpu_memory, cpu_memory=cpu_memory)
    try:
        ex.on_action = hook
        sel = GreedyRecorder(stop_ids)
        ex.generate_block(prompts, max_new, sel)
        return sel.tokens, ex
    finally:
        ex.close()


def run_logits(loaded, policy, prompts, max_new, disk_dir=None, device: torch.device = torch.device("cpu"),
               **executor_kwargs) -> LogitRecorder:
    """One block of `prompts` under `policy` in fp32: the LogitRecorder (tokens and logits per row)."""
    ex = Executor(loaded, policy, device=device, dtype=torch.float32, disk_dir=disk_dir, **executor_kwargs)
    try:
        sel = LogitRecorder()
        ex.generate_block(prompts, max_new, sel)
        return sel
    finally:
        ex.close()
