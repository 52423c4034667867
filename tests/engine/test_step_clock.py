"""`StepClock`: the union of transfer spans (CPU), and on CUDA one entry per step whose spans fit the step and
whose tokens are the unclocked run's (the clock only records events, it must not change what runs)."""
from __future__ import annotations

import pytest
import torch

from engine.models.loader import load_model
from engine.policy.policy import Policy
from engine.runtime.executor import Executor
from engine.runtime.step_clock import StepClock, _union
from helpers.greedy_runs import GreedyRecorder, make_prompts
from helpers.skips import requires_cuda


@pytest.mark.parametrize("spans, total", [
    ([], 0.0),
    ([(0.0, 2.0)], 2.0),
    ([(0.0, 2.0), (1.0, 3.0)], 3.0),            # overlapping
    ([(0.0, 1.0), (2.0, 3.0)], 2.0),            # disjoint
    ([(0.0, 5.0), (1.0, 2.0)], 5.0),            # nested
    ([(2.0, 3.0), (-1.0, 0.5)], 2.5),           # unsorted, before the reference
])
def test_union_of_spans(spans, total):
    assert _union(spans) == pytest.approx(total)


def test_a_step_without_events_adds_nothing():
    clock = StepClock()
    clock.host_wait("load", 0.5)
    clock.close_step()
    assert clock.take() == []


def _run(loaded, policy: Policy, blocks, clock: StepClock | None) -> tuple[list[dict], list[float]]:
    ex = Executor(loaded, policy, device=torch.device("cuda"), dtype=torch.float32)
    ex.transfers.clock = clock
    sels = [GreedyRecorder() for _ in blocks]
    steps: list[float] = []
    try:
        for _ in ex.generate_blocks([(p, m, s) for (p, m), s in zip(blocks, sels)]):
            steps += ex.step_s
    finally:
        ex.close()
    return [s.tokens for s in sels], steps


@requires_cuda
@pytest.mark.parametrize("extra", [{}, {"prefill_ahead": True}])
def test_cuda_clock_sees_every_step(tiny_checkpoints, extra):
    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.float32)
    V = loaded.config.vocab_size
    blocks = [(make_prompts(6, V, seed=s), [5, 9, 3, 9, 7, 2]) for s in (1, 2)]
    policy = Policy(gpu_batch_size=3, num_gpu_batches=2, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.5, cache_cpu=0.5,
                    compress_cache=True, **extra)
    ref, _ = _run(loaded, policy, blocks, None)
    clock = StepClock()
    got, step_s = _run(loaded, policy, blocks, clock)
    seen = clock.take()
    assert got == ref
    assert len(seen) == len(step_s)
    for n, (entry, wall) in enumerate(zip(seen, step_s)):
        assert entry["h2d_busy_s"] > 0, (n, entry)           # the weights stream from the host every step
        assert 0 <= entry["host_gap_s"] <= entry["span_s"], (n, entry)
        on_stream = entry["compute_s"] + entry["ahead_s"] + entry["other_s"]   # one stream, spans in this step
        assert on_stream <= wall + 1e-3, (n, wall, entry)
        assert 0 <= entry["lead_s"]["min"] <= entry["lead_s"]["median"] <= wall, (n, wall, entry)
        assert "compute" in entry["host_s"] and all(s >= 0 for s in entry["host_s"].values()), (n, entry)
        assert 0 <= entry["gc_s"] <= wall, (n, wall, entry)
        assert entry["compute_s"] > 0 and entry["h2d_busy_s"] <= entry["span_s"] + 1e-6, (n, entry)
        assert all(s >= 0 for s in entry["host_wait_s"].values()), (n, entry)
        assert set(entry["allocator"]) == {"retries", "device_allocs", "device_frees"}, (n, entry)
        assert all(c >= 0 for c in entry["allocator"].values()), (n, entry)
    if extra:
        assert any(e["ahead_s"] > 0 for e in seen)
