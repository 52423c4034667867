"""The shared prompt prefix a GPU batch computes once: the executor's rule, for the cost and memory models.

A GPU batch of more than one row whose prompts share at least `MIN_SHARED_PREFIX` leading tokens runs its
prefill as one prefix [1, L] (embedding, q/k/v, attention and MLP computed once for the batch) and the
rows' suffixes [g, s - L], which attend to the prefix's keys (`engine.runtime.batch.GpuBatch`,
`engine.runtime.prefill_chunks`, `engine.models.attention.prefix_attention` / `suffix_attention`). The
prefix's keys and values are then held once for the batch, dense on the compute device
(`engine.runtime.kv_cache.KVHome.prefix`, [1, nkv, L, hd] per attention layer; with CPU attention a host
copy of the off-device heads), and every row's KV cache holds its own S - L positions only: cache bytes,
cache stores, the 4-bit quantization of the new cache and the decode's cache loads shrink by the prefix,
while attention still reads L + own keys (decode assembles them per chunk of rows on the device). The
prefill's hidden state is a (prefix, rows) pair, which `engine.runtime.act_homes.ActHomes` never parks off
the device: it stays on the gpu between layers whatever the policy's activation placement says, and only
the decode steps' hidden states [g, 1, h] are parked.
"""
from __future__ import annotations

MIN_SHARED_PREFIX = 4   # a GPU batch's common leading tokens are computed once when at least this many


def batch_prefix_len(shared_prefix_len: int, gpu_batch_size: int) -> int:
    """Leading tokens a GPU batch of `gpu_batch_size` rows computes once, when every prompt of the run shares
    `shared_prefix_len`: all of them when there are at least `MIN_SHARED_PREFIX` and more than one row (a
    batch may share more than the run; the model counts what every batch is sure to share), else 0."""
    return shared_prefix_len if gpu_batch_size > 1 and shared_prefix_len >= MIN_SHARED_PREFIX else 0
