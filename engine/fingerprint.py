"""The output fingerprint: one id of everything that decides which tokens an `LLM` generates.

`output_fingerprint` hashes the model weights' fingerprint (engine.models.loader: a digest of every byte of
every weight file, `engine.util.file_digest`, so a copy with two tensors swapped or a fine-tune that shares
the metadata and the last tensors never matches the original), the tokenizer
(`tokenizer_digest`: tokenizer.json, the special tokens and BOS rule, the chat template text), the dtype, the
compression flags and `NUMERICS_VERSION`. Callers key stored results by it (llmops' result cache): two LLMs
with equal fingerprints produce equal outputs for equal prompts and sampling parameters.

Bump rule for `NUMERICS_VERSION`: increment it in the same change as anything that alters the tokens
generated for an unchanged model, tokenizer, dtype and prompt (a kernel's summation order, the sampler, the
constraint's steering, prompt encoding, the chat template's rendering, stop handling, the detokenizer), so
that results stored by the older code are recomputed rather than served. A change that keeps every token
(speed, placement, memory) leaves it alone.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

NUMERICS_VERSION = 8   # 1: the first versioned numerics; 2: pattern/enum strings close in budget;
#                        3: prefill in row chunks (another summation order for large batches), sliding windows;
#                        4: decode attention over a rotated 4-bit cache in the rotated basis (rotated q, output
#                           un-rotated once: another summation order than un-rotating every cached row);
#                        5: fused Triton RMSNorm, silu(gate) * up and quantize on CUDA (another summation order
#                           for the norm's statistics and the cache's Hadamard rotation, Triton's exp/rsqrt);
#                        6: the routed experts through torch._grouped_mm in bf16 on CUDA sm90+ (another summation
#                           order than the grouped bmm; also covers the fused 4-bit decode attention on
#                           CUDA, whose softmax runs in another order than the unfused one);
#                        7: decode attention over a bfloat16 cache on the CPU by the C kernel
#                           (engine.models.native_attention: another summation order than SDPA's);
#                        8: a shared prefix's part of the fused 4-bit decode attention on CUDA by batched
#                           float32 GEMMs (engine.models.quant_decode.prefix_state: another summation order)


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 (hex, 32 characters) of a `engine.decoding.tokenizer.Tokenizer`: its tokenizer.json bytes, BOS/EOS
    tokens, BOS rule and chat template text (wherever the template came from: tokenizer_config.json or
    chat_template.jinja / .json). "none" for a model without a tokenizer."""
    if tokenizer is None:
        return "none"
    h = hashlib.sha256(tokenizer.path.read_bytes())
    facts = {"bos": tokenizer.bos_token, "eos": tokenizer.eos_token, "add_bos": tokenizer.add_bos_token,
             "chat_template": tokenizer.chat_template}
    h.update(json.dumps(facts, sort_keys=True, default=str).encode("utf-8"))
    return h.hexdigest()[:32]


def output_fingerprint(weights: str, tokenizer: str, dtype: torch.dtype, *, compress_weights: bool,
                       compress_cache: bool, eos_token_ids: tuple[int, ...] = ()) -> str:
    """32 hex characters over (weights fingerprint, tokenizer digest, dtype, compression flags, EOS ids,
    NUMERICS_VERSION)."""
    key = (f"{weights}|tok={tokenizer}|{dtype}|w4={compress_weights}|c4={compress_cache}|"
           f"eos={list(eos_token_ids)}|numerics={NUMERICS_VERSION}")
    return hashlib.sha256(key.encode()).hexdigest()[:32]
