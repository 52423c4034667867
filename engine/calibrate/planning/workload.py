"""Planning buckets: the workload a plan is made for, rounded so that nearby jobs share one plan.

A job's workload (`engine.policy.cost_model.Workload`) is planned in buckets: the longest prompt, the mean
prompt and the new tokens rounded up to 4 steps per octave (`bucket`), the prompt count as it is between
`EXACT_COUNT_MIN` and `EXACT_COUNT_MAX` and up to a power of two outside (`count_bucket`), the shared prefix
down to a multiple of `PREFIX_STEP` tokens (the mean prompt is then the prefix plus the mean of the rows' own
tokens rounded up). Rounding the lengths up and the prefix down keeps a bucket's memory a bound for every
workload inside it (a longer prefix computes less).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from engine.policy.cost_model import Workload
from engine.runtime.batch import shared_prefix_len

PREFIX_STEP = 16   # a bucket's shared prefix: the workload's rounded down to a multiple of this
EXACT_COUNT_MIN = 1 << 10   # prompt counts from just above this to EXACT_COUNT_MAX are planned as they are,
EXACT_COUNT_MAX = 1 << 16   # the others by powers of two


def bucket(n: int) -> int:
    """`n` rounded up to 4 steps per octave: 1..8 as is, then 10, 12, 14, 16, 20, 24, 28, 32, 40, ..."""
    n = max(1, int(n))
    if n <= 8:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def exact_count(n: int) -> bool:
    """Whether a bucket plans `n` prompts as they are (`count_bucket`), not rounded to a power of two."""
    return EXACT_COUNT_MIN < n <= EXACT_COUNT_MAX


def count_bucket(n: int | None) -> int | None:
    """The prompt count a bucket plans for: `n` itself from just above `EXACT_COUNT_MIN` to `EXACT_COUNT_MAX`
    (`exact_count`), else the next power of two (None, unbounded, stays None). The count decides a plan through
    its blocks: how many there are, how full the last one is, and whether a prefill can run ahead of them. A job
    of a few blocks planned for the next power of two pays for blocks it does not fill: `llmops policy --model
    llama-3-70b --hardware h200 --gpu-memory 16GiB --cpu-memory 88GiB --compress-weights --compress-cache
    --prompt-len 200 --max-prompt-len 224 --gen-len 10 --shared-prefix-len 150` plans 1536x1 with the prefill
    ahead for `--num-prompts 4608`, and 4096-row blocks for 8192, of which a 4,608-row job would run two, the
    second an eighth full (tests/engine/test_job_plan.py: the job's own plan is predicted more than 1.5x as
    fast for its rows). Past `EXACT_COUNT_MAX` a job runs enough blocks for the rounding to cost little; up to
    `EXACT_COUNT_MIN` one block mostly holds every row, and calls of nearby small counts keep one plan (and one
    executor) instead of one each."""
    if n is None:
        return None
    n = max(1, int(n))
    return n if exact_count(n) else 1 << (n - 1).bit_length()


def prompts_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    """Leading tokens every one of the token `prompts` shares, by the executor's rule for a GPU batch
    (`engine.runtime.batch.shared_prefix_len`: each prompt keeps at least one token of its own); 0 for fewer
    than two prompts."""
    return shared_prefix_len([list(p) for p in prompts]) if len(prompts) > 1 else 0


def workload_from_prompts(prompt_lens: Sequence[int], max_new_tokens: int, shared_prefix_len: int = 0) -> Workload:
    """The exact workload of prompts of `prompt_lens` tokens: the mean prompt for time, the longest for
    memory, the count as the block-size bound, the leading tokens all prompts share."""
    lens = [max(1, int(n)) for n in prompt_lens] or [1]
    return Workload(prompt_len=math.ceil(sum(lens) / len(lens)), gen_len=max(1, max_new_tokens),
                    num_prompts=len(lens), max_prompt_len=max(lens), shared_prefix_len=shared_prefix_len)


def bucketed(prompt_lens: Sequence[int], max_new_tokens: int, shared_prefix_len: int = 0, *,
             rows: int | None = None) -> Workload:
    """The planning bucket of prompts of `prompt_lens` tokens (`bucketed_workload` of their workload);
    `rows`: the job's prompt count when the lengths are a sample of it."""
    w = workload_from_prompts(prompt_lens, max_new_tokens, shared_prefix_len)
    return bucketed_workload(replace(w, num_prompts=rows) if rows else w)


def bucketed_workload(w: Workload) -> Workload:
    """The planning bucket of `w` (see module docstring). The rows' own tokens are what the prefill pays per
    row, so they are rounded, not the whole prompt: 150 shared + 50 own is planned as 144 + 56, not as 224
    tokens with 144 of them shared. An unbounded prompt count (None) stays unbounded."""
    count = count_bucket(w.num_prompts)
    longest = bucket(w.memory_prompt_len)
    prefix = w.shared_prefix_len // PREFIX_STEP * PREFIX_STEP
    mean = prefix + bucket(w.prompt_len - prefix)
    return Workload(prompt_len=min(longest, mean), gen_len=bucket(w.gen_len), num_prompts=count,
                    max_prompt_len=longest, shared_prefix_len=prefix)


def merged(a: Workload, b: Workload) -> Workload:
    """A bucket holding both workloads (the larger of each figure, the smaller of the shared prefixes)."""
    counts = (a.num_prompts, b.num_prompts)
    return Workload(prompt_len=max(a.prompt_len, b.prompt_len), gen_len=max(a.gen_len, b.gen_len),
                    num_prompts=None if None in counts else max(counts),
                    max_prompt_len=max(a.memory_prompt_len, b.memory_prompt_len),
                    shared_prefix_len=min(a.shared_prefix_len, b.shared_prefix_len))


def covers(bucket_: Workload | None, workload: Workload) -> bool:
    """Whether a plan for `bucket_` (None: a fixed policy, which covers everything) bounds `workload`'s memory:
    its longest prompt and new tokens fit the bucket, and its prompts share at least the bucket's prefix."""
    w = bucket_
    return w is None or (workload.memory_prompt_len <= w.memory_prompt_len and workload.gen_len <= w.gen_len
                         and workload.shared_prefix_len >= w.shared_prefix_len)


def workload_list(w: Workload) -> list[int]:
    """A workload as the plan cache keys and stores it: prompt, new tokens, prompts (0: unbounded), longest,
    shared prefix."""
    return [w.prompt_len, w.gen_len, int(w.num_prompts or 0), w.memory_prompt_len, w.shared_prefix_len]


def workload_from_list(values: Sequence[int]) -> Workload:
    """Inverse of `workload_list`."""
    prompt, gen, count, longest, prefix = (int(v) for v in values)
    return Workload(prompt_len=prompt, gen_len=gen, num_prompts=count or None, max_prompt_len=longest,
                    shared_prefix_len=prefix)
