"""Token choice as pure functions over a batch of logits: greedy, temperature, top-k, top-p, logprobs.

Reproducible sampling without a global RNG stream: every sequence has a 64-bit key derived from
(seed, its prompt token ids, its occurrence index among identical prompts), and the uniform number used at
decode step t is a counter-based hash of (key, t). A sequence therefore draws the same numbers whatever
batch, block or run it lands in. Tokens are drawn by inverse-CDF from one uniform per row, so a batch is a
handful of tensor ops, not a Python loop.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import torch

from engine.decoding.native_argmax import native_argmax

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
NUCLEUS_CANDIDATES = 256  # top-p looks at this many most likely tokens before sorting a whole row


def sequence_key(seed: int, prompt: Sequence[int], occurrence: int = 0) -> int:
    """A 64-bit key for one sequence: a hash of (seed, prompt token ids, occurrence index)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(int(seed).to_bytes(16, "little", signed=True))
    h.update(int(occurrence).to_bytes(8, "little", signed=False))
    h.update(np.asarray(prompt, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def sequence_keys(seed: int, prompts: Sequence[Sequence[int]]) -> list[int]:
    """Keys for a list of prompts in input order; the k-th copy of an identical prompt gets occurrence k."""
    seen: dict[tuple[int, ...], int] = {}
    keys = []
    for prompt in prompts:
        t = tuple(prompt)
        occurrence = seen.get(t, 0)
        seen[t] = occurrence + 1
        keys.append(sequence_key(seed, prompt, occurrence))
    return keys


def uniforms(keys: Sequence[int], steps: Sequence[int]) -> np.ndarray:
    """One uniform in [0, 1) per (key, step) pair: splitmix64 of key + step * golden ratio. float64 [n]."""
    k = np.asarray(keys, dtype=np.uint64)
    t = np.asarray(steps, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = k + (t + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (2.0 ** -53)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [n, v] -> token ids [n] int64 (first maximum on ties, as torch.argmax): bfloat16 logits on the CPU
    by `native_argmax`, others through `max` over the last dim (the same indices, and on the CPU a kernel
    that reads a decode step's logits faster than argmax's)."""
    chosen = native_argmax(logits)
    return logits.max(dim=-1).indices if chosen is None else chosen


def sample(logits: torch.Tensor, u: torch.Tensor, *, temperature: float, top_k: int = 0,
           top_p: float = 1.0) -> torch.Tensor:
    """Draw one token per row by inverse CDF. logits [n, v] (any float dtype: drawn in float32), u [n] uniforms
    in [0, 1) -> ids [n].

    `temperature` > 0 divides the logits; `top_k` > 0 keeps the k most likely tokens; `top_p` < 1 then
    keeps the smallest set of most likely tokens whose probability (renormalised after top-k) reaches
    top_p (the most likely always kept). Tokens at -inf (masked by a grammar) are never drawn unless every
    token of the row is masked. Each row's draw depends only on its own logits and u.
    """
    if temperature <= 0:
        raise ValueError(f"sample: temperature must be > 0, got {temperature}")
    scores = logits.float() / temperature                               # [n, v]
    n, v = scores.shape
    u = u.to(device=scores.device, dtype=torch.float32)
    if 0 < top_k < v:
        vals, index = scores.topk(top_k, dim=-1)                        # [n, k] sorted descending
        return _draw(vals, index, torch.logsumexp(vals, -1, keepdim=True), u, top_p)
    if top_p >= 1.0:
        probs = torch.softmax(scores, dim=-1)                           # [n, v]
        return _inverse_cdf(probs, u)
    # top-p: the nucleus almost always lies in the top few hundred tokens; rows where it may not are
    # sorted in full. The choice is per row, so a row draws the same token in any batch.
    lse = torch.logsumexp(scores, -1, keepdim=True)                     # [n, 1]
    k = min(v, NUCLEUS_CANDIDATES)
    vals, index = scores.topk(k, dim=-1)                                # [n, k]
    covered = torch.exp(vals - lse).sum(-1) >= top_p                    # [n]
    if k == v or bool(covered.all()):
        return _draw(vals, index, lse, u, top_p)
    out = torch.empty(n, dtype=torch.int64, device=scores.device)
    out[covered] = _draw(vals[covered], index[covered], lse[covered], u[covered], top_p)
    rest = ~covered
    full, full_index = scores[rest].sort(dim=-1, descending=True)      # [m, v]
    out[rest] = _draw(full, full_index, lse[rest], u[rest], top_p)
    return out


def _draw(vals: torch.Tensor, index: torch.Tensor, lse: torch.Tensor, u: torch.Tensor, top_p: float) -> torch.Tensor:
    """vals [m, c] sorted descending with their token ids `index` [m, c]; probabilities exp(vals - lse)."""
    probs = torch.exp(vals - lse)                                       # [m, c]
    if top_p < 1.0:
        before = probs.cumsum(dim=-1) - probs                           # mass strictly above each token
        probs = probs * (before < top_p)
    return index.gather(-1, _inverse_cdf(probs, u).unsqueeze(-1)).squeeze(-1)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column of the first cdf entry above u * total: probs [m, c] (unnormalised), u [m] -> [m]."""
    cdf = probs.cumsum(dim=-1)                                          # [m, c]
    target = u.unsqueeze(-1) * cdf[:, -1:]                              # [m, 1]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(-1)


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[row, token] in float32: logits [n, v], tokens [n] -> [n]."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
