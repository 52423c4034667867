"""The shared prompt prefix a GPU batch computes once: the executor's rule, for the cost and memory models.

A GPU batch of more than one row whose prompts share at least `MIN_SHARED_PREFIX` leading tokens runs its
prefill as one prefix [1, L] (embedding, q/k/v, attention and MLP computed once for the batch) and the
rows' suffixes [g, s - L], which attend to the prefix's keys (`engine.runtime.batch.GpuBatch`,
`engine.runtime.prefill_chunks`, `engine.models.attention.prefix_attention` / `suffix_attention`).
Where `prefix_held_once` says (an accelerator, or a 4-bit cache), the prefix's keys and values are then held
once for the batch, dense on the compute device (`engine.runtime.kv_cache.KVHome.prefix`, [1, nkv, L, hd]
per attention layer; with CPU attention a host copy of the off-device heads), and every row's KV cache
holds its own S - L positions only: cache bytes, cache stores, the 4-bit quantization of the new cache and
the decode's cache loads shrink by the prefix, while attention still reads L + own keys (decode assembles
them per chunk of rows). Otherwise (a dense cache on a CPU device, which is compute memory: sharing would
save memory only, and the per-step assembly of prefix + own keys costs copies that attending a row's whole
cache in place does not) the prefix's keys are written into every row as the rows' own. The
prefill's hidden state is a (prefix, rows) pair, which `engine.runtime.act_homes.ActHomes` never parks off
the device: it stays on the gpu between layers whatever the policy's activation placement says, and only
the decode steps' hidden states [g, 1, h] are parked.
"""
from __future__ import annotations

MIN_SHARED_PREFIX = 4   # a GPU batch's common leading tokens are computed once when at least this many


def prefix_held_once(device_type: str, compressed_cache: bool) -> bool:
    """Whether a GPU batch's shared prefix keys/values are held once rather than in every row's cache: on
    an accelerator, or with a 4-bit cache anywhere."""
    return device_type != "cpu" or compressed_cache


def batch_prefix_len(shared_prefix_len: int, gpu_batch_size: int) -> int:
    """Leading tokens a GPU batch of `gpu_batch_size` rows computes once, when every prompt of the run shares
    `shared_prefix_len`: all of them when there are at least `MIN_SHARED_PREFIX` and more than one row (a
    batch may share more than the run; the model counts what every batch is sure to share), else 0."""
    return shared_prefix_len if gpu_batch_size > 1 and shared_prefix_len >= MIN_SHARED_PREFIX else 0
