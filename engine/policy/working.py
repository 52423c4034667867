"""Estimate of the compute device's working memory for one GPU batch (pure arithmetic).

In the policy package so the memory model (`memory`) and the runtime's executor share one formula with the
arrow pointing down (runtime -> policy).

Counted against the gpu budget at block start: the live intermediates of the larger of one attention or
one MLP layer at prefill (per token: hidden, residual, normed input, q/k/v, attention output; or gate/up,
activation, down output), SDPA's boolean mask, the head's float32 logits, and with a compressed cache the
dense keys/values dequantized for one segment's attention, and with soft-capped attention (Gemma2: no fused
kernel) the explicit float scores and probabilities. A fixed margin covers the allocator's rounding.
"""
from __future__ import annotations

import torch

from engine.models.config import ModelConfig

_MARGIN = 16 << 20


def working_bytes(c: ModelConfig, b: int, s: int, length: int, dtype: torch.dtype, compressed_cache: bool) -> int:
    """Bytes of device working memory for b rows of s new tokens over a cache of `length` positions."""
    e = torch.empty((), dtype=dtype).element_size()
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    attn = (4 * c.hidden_size + 3 * qkv + 2 * c.num_attention_heads * c.head_dim) * e
    experts = max(1, c.num_experts_per_tok)
    mlp = (4 * c.hidden_size + 3 * c.intermediate_size * experts) * e
    if c.is_moe:
        mlp += c.num_local_experts * 8 + 2 * experts * c.hidden_size * e
    per_token = max(attn, mlp)
    mask = b * s * length
    logits = b * c.vocab_size * 4 * 2
    dense_cache = 4 * b * c.num_key_value_heads * length * c.head_dim * e if compressed_cache else 0
    scores = 3 * b * c.num_attention_heads * s * length * 4 if c.attn_logit_softcapping is not None else 0
    return b * s * per_token + mask + logits + dense_cache + scores + _MARGIN
