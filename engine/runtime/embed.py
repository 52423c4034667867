"""Embeddings: one forward pass of the decoder over each text, no decoding (what `engine.LLM.embed` runs).

A text's embedding is the mean over its tokens of the last decoder layer's hidden states, each first scaled to
unit root-mean-square (the final norm without its learned gain, so it is the same rule for every family and
no token's outlier dimensions dominate), then scaled to unit length: the cosine similarity of two texts is
the dot product of their embeddings. The forward is the runtime's prefill path (`attention_layer` over a
batch's own keys, causal, inside each layer's sliding window) with no KV cache kept; the output head is never
run.

`Embedder` owns one dense copy of the decoder's weights on the compute device, built from the model's weight
source on the first call and kept (embeddings are a whole-model pass per batch, so there is no placement
policy: the model must fit the device, `fits`). Texts are sorted by length and run in batches of at most
`BATCH_TOKENS` padded tokens (left padding, as the runtime pads).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.models.attention import attention_layer, prefill_attention
from engine.models.loader import LoadedModel

BATCH_TOKENS = 8192     # padded tokens per forward batch: bounds the [b, s, h] activations and [b, nh, s, s] scores


@dataclass(frozen=True)
class Embedding:
    """One text's embedding: `vector` (unit length; None when the text could not run), the text's `tokens`, and
    `error` saying why there is no vector."""

    vector: list[float] | None
    tokens: int
    error: str | None = None


class _Batch:
    """The `AttentionBatch` of one prefill-only pass: positions [b, s] and key validity [b, s] (left padding)."""

    prefill = True

    def __init__(self, valid: torch.Tensor) -> None:
        self.key_valid = valid                                           # [b, s] bool
        self.key_valid_host = valid
        self.positions = (valid.long().cumsum(-1) - 1).clamp(min=0)      # [b, s]: 0 = first real token
        self.t = valid.shape[1]


class _NoCache:
    """The `CacheAttention` of a pass that keeps no cache: causal attention over the batch's own keys."""

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                softcap: float | None = None) -> torch.Tensor:
        return prefill_attention(q, k, v, mask, scale, softcap)         # [b, nh, s, hd]


def pool(hidden: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """hidden [b, s, h], valid [b, s] bool -> unit-length embeddings [b, h] float32: the mean of the valid
    tokens' hidden states, each scaled to unit root-mean-square first. Pure."""
    x = hidden.float()                                                   # [b, s, h]
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)          # [b, s, h], unit RMS per token
    w = valid.float().unsqueeze(-1)                                      # [b, s, 1]
    mean = (x * w).sum(1) / w.sum(1).clamp(min=1)                        # [b, h]
    return torch.nn.functional.normalize(mean, dim=-1)                   # [b, h]


class Embedder:
    """Runs embedding passes of one loaded model on `device` in `dtype` (see module docstring)."""

    def __init__(self, loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> None:
        self.loaded, self.device, self.dtype = loaded, device, dtype
        self.specs = [s for s in loaded.family.layer_specs() if s.kind != "head"]
        self._weights: dict[str, dict[str, Any]] | None = None

    def nbytes(self) -> int:
        """Bytes of the weights an embedding pass holds on the device (every layer but the output head)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(w.numel for s in self.specs for w in s.weights.values()) * size

    def fits(self, budget: int | None) -> str | None:
        """None when the weights fit `budget` bytes (None: no budget), else why not."""
        need = self.nbytes()
        if budget is not None and need > budget:
            return (f"embedding holds the whole model on the device: {need / 2**30:.2f} GiB of weights do not fit "
                    f"gpu_memory={budget / 2**30:.2f} GiB")
        return None

    def _layer_weights(self) -> dict[str, dict[str, Any]]:
        if self._weights is None:
            source = self.loaded.weights
            self._weights = {s.name: {k: v.to(self.device, self.dtype) for k, v in source.get(s).items()}
                             for s in self.specs}
        return self._weights

    @torch.inference_mode()
    def embed(self, ids: list[list[int]]) -> torch.Tensor:
        """Token ids per text (each non-empty) -> unit-length embeddings [n, h] float32 on the CPU, in order."""
        out = torch.empty(len(ids), self.loaded.config.hidden_size)      # [n, h]
        batch: list[int] = []
        for i in sorted(range(len(ids)), key=lambda i: len(ids[i])):     # each new text is the batch's longest
            if batch and (len(batch) + 1) * len(ids[i]) > BATCH_TOKENS:
                out[batch] = self._forward([ids[j] for j in batch]).cpu()
                batch = []
            batch.append(i)
        if batch:
            out[batch] = self._forward([ids[j] for j in batch]).cpu()
        return out

    def _forward(self, ids: list[list[int]]) -> torch.Tensor:
        """One batch of token ids -> embeddings [b, h]: left-padded forward through every decoder layer."""
        c, f, weights = self.loaded.config, self.loaded.family, self._layer_weights()
        s = max(len(x) for x in ids)
        input_ids = torch.zeros(len(ids), s, dtype=torch.long)           # [b, s]
        valid = torch.zeros(len(ids), s, dtype=torch.bool)               # [b, s]
        for r, x in enumerate(ids):
            input_ids[r, s - len(x):] = torch.tensor(x)
            valid[r, s - len(x):] = True
        input_ids, valid = input_ids.to(self.device), valid.to(self.device)
        batch, kv = _Batch(valid), _NoCache()
        hidden: torch.Tensor | None = None
        for spec in self.specs:
            w = weights[spec.name]
            if spec.kind == "embed":
                hidden = f.embed(w, input_ids, batch.positions)          # [b, s, h]
            elif spec.kind == "attention":
                hidden = attention_layer(c, f, w, kv, batch, spec.index, hidden)   # [b, s, h]
            else:
                hidden = f.mlp(w, hidden)                                # [b, s, h]
        return pool(hidden, valid)                                       # [b, h]
