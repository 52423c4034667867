"""Several GPUs of one host for benchmarks/throughput/throughput.py (`--gpus N`): the same rows through N devices.

`run_multi` runs the blocks of one policy on N devices as `LLM(devices=...)` would (`engine.parallel`):
pipeline stages when the policy streams weights (N blocks at a time as the N micro-batches), data-parallel
lanes when every weight stays on the GPU. `TokenRecorder` is GreedyToEnd that also keeps every row's tokens,
so `tokens_digest` of the 1-GPU and N-GPU runs of one invocation can be compared (`tokens_match_1gpu`).
On a machine without CUDA the N "devices" are N CPU devices (a smoke test of the same code); with
`--one-device` they are N copies of the first device (cuda:0): the N-device code on a machine of one GPU, each
stage or lane with its own `--gpu-memory` budget there, where the tokens must match and no speed-up is expected.
"""
from __future__ import annotations

import hashlib
import json
from typing import Sequence

from benchmarks.common import Timer, close_and_release, failure_fields, peak_gib, reset_peak
from benchmarks.profiling.timeline import SELECT_MARK

import torch
from torch.profiler import record_function

from engine.parallel import Lanes, build_pipeline, choose_parallel
from engine.policy.policy import Policy
from engine.runtime.selector import GreedyToEnd

WARMUP_TOKENS = 2      # a prefill and a decode step: one-time costs (kernel builds) land before timing


class TokenRecorder(GreedyToEnd):
    """GreedyToEnd (argmax, never finishes a row) keeping each row's tokens in `rows`."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, list[int]] = {}

    def __call__(self, rows: Sequence[int], logits: torch.Tensor) -> tuple[list[int], list[bool]]:
        with record_function(SELECT_MARK):                  # a trace's phase marks (`profiling/timeline.py`)
            picked, finished = super().__call__(rows, logits)
        for r, t in zip(rows, picked):
            self.rows.setdefault(r, []).append(t)
        return picked, finished


def tokens_digest(recorders: Sequence[TokenRecorder]) -> str:
    """sha256 of every block's rows' tokens, in block order."""
    data = [sorted(rec.rows.items()) for rec in recorders]
    return hashlib.sha256(json.dumps(data).encode()).hexdigest()


def gpu_devices(n: int, one_device: bool = False) -> list[torch.device]:
    """The first n CUDA devices (`one_device`: cuda:0 n times), or n CPU devices without CUDA."""
    if not torch.cuda.is_available():
        return [torch.device("cpu")] * n
    if one_device:
        return [torch.device("cuda", 0)] * n
    if torch.cuda.device_count() < n:
        raise ValueError(f"--gpus {n}: only {torch.cuda.device_count()} CUDA devices are visible")
    return [torch.device("cuda", i) for i in range(n)]


def run_multi(loaded, policy: Policy, prompts: list[list[int]], args, n: int, dtype: torch.dtype) -> dict:
    """The rows in blocks of policy.block_size on n devices (a warm-up of WARMUP_TOKENS first: a block per
    lane, or a block per micro-batch of the pipeline)."""
    mode = choose_parallel("auto", policy, n)
    out: dict = {"policy": policy.to_dict(), "parallel": mode}
    engine = None
    size = policy.block_size
    blocks = [prompts[s:s + size] for s in range(0, len(prompts), size)]
    out["micro_batches"] = min(n, len(blocks)) if mode == "pipeline" else None
    try:
        devices = gpu_devices(n, args.one_device)
        out["devices"] = [str(d) for d in devices]
        with Timer() as init:
            build = Lanes if mode == "data" else build_pipeline
            engine = build(loaded, policy, devices, dtype=dtype, gpu_memory=args.gpu_memory,
                           cpu_memory=args.cpu_memory, disk_dir=args.disk_dir)
        out["init_s"] = init.seconds
        recorders = [TokenRecorder() for _ in blocks]
        if mode == "data":
            def job(block, rec, gen):
                return lambda ex: ex.generate_block(block, [gen] * len(block), rec)
            warm = [job(blocks[0], GreedyToEnd(), WARMUP_TOKENS) for _ in devices] if args.warmup else []
            list(engine.run(warm))
            reset_peak(n)
            with Timer() as run:
                list(engine.run([job(b, rec, args.gen_len) for b, rec in zip(blocks, recorders)]))
        else:
            if args.warmup:
                engine.generate([(b, [WARMUP_TOKENS] * len(b), GreedyToEnd()) for b in blocks[:n]])
            reset_peak(n)
            with Timer() as run:
                for start in range(0, len(blocks), n):
                    engine.generate([(b, [args.gen_len] * len(b), rec)
                                     for b, rec in zip(blocks[start:start + n], recorders[start:start + n])])
        out.update(ok=True, total_s=run.seconds, blocks=len(blocks), generated_tokens=sum(r.tokens for r in recorders),
                   tokens_digest=tokens_digest(recorders), executor_memory=engine.memory_report(), **peak_gib(n))
    except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError, ValueError) as err:
        out.update(failure_fields(err))
    finally:
        close_and_release(engine)
    return out
