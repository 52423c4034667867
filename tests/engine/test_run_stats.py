"""Where an engine's time goes (`engine.runtime.run_stats.EngineStats`, counted by `engine.LLM`) and rows
finished per time bucket (`llmops.row_clock.RowClock`): the measurements behind the run report."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runtime.run_stats import SECONDS, EngineStats
from helpers.skips import requires_cuda
from llmops.row_clock import RowClock


def test_since_subtracts_counters_and_keeps_the_latest_peaks():
    stats = EngineStats(load_s=2.0)
    before = stats.snapshot()
    stats.add_block(prefill_s=1.0, decode_s=3.0, grammar_s={"prefill": 0.25, "decode": 0.5},
                    callback_s={"decode": 0.5}, steps=4, tokens=10, peak_bytes={"gpu": 100, "cpu": 7},
                    grammar_advance_s=0.5)
    stats.plan_s += 0.5
    got = stats.since(before)
    assert (got.load_s, got.plan_s, got.prefill_s, got.decode_s) == (0.0, 0.5, 0.75, 2.0)
    assert (got.grammar_mask_s, got.callback_s, got.blocks, got.steps, got.generated_tokens) == (0.75, 0.5, 1, 4, 10)
    assert got.grammar_advance_s == 0.5
    assert got.peak_bytes == {"gpu": 100, "cpu": 7, "disk": 0}
    assert before.peak_bytes == {"gpu": 0, "cpu": 0, "disk": 0}      # a snapshot does not move
    assert set(SECONDS) <= set(got.to_dict())


def test_row_clock_widens_its_buckets_and_keeps_every_row():
    clock = RowClock(bucket_s=1.0, max_buckets=4)
    for second in range(10):
        clock.add(second + 0.5, 1)
    clock.add(0.1, 0)
    assert clock.total == 10 and len(clock.rows) <= 4 and clock.bucket_s == 4.0
    assert clock.to_dict() == {"bucket_s": 4.0, "rows": [4, 4, 2]}
    with pytest.raises(ValueError, match="bucket_s"):
        RowClock(bucket_s=0)


def test_llm_counts_load_plan_prefill_decode_grammar_and_peaks(tiny_llama):
    with LLM(tiny_llama, dtype="float32", device="cpu") as llm:
        assert llm.stats.load_s > 0 and llm.stats.blocks == 0
        before = llm.stats.snapshot()
        seen = []
        params = SamplingParams(max_new_tokens=4, choices=("alpha", "beta"))
        out = [c for group in llm.stream(["pick one", "another"], params, on_finished=lambda i, c: seen.append(i))
               for _, c in group]
        got = llm.stats.since(before)
    assert got.load_s == 0 and got.plan_s > 0 and got.place_s > 0
    assert got.prefill_s > 0 and got.grammar_mask_s > 0 and got.blocks == 1
    assert 0 < got.grammar_advance_s <= got.grammar_mask_s
    assert got.generated_tokens == sum(len(c.token_ids) for c in out)
    assert got.steps == max(len(c.token_ids) for c in out)             # prefill + each decode step
    assert got.peak_bytes["gpu"] > 0 and got.device_peak_bytes is None  # the CPU holds the "gpu" tier here
    assert sorted(seen) == [0, 1] and got.callback_s > 0                 # the hook ran, timed
    plan = llm.last_plan.to_dict()
    assert plan["predicted_peak_bytes"]["gpu"] > 0 and plan["predicted_decode_s"] > 0


@requires_cuda
def test_on_cuda_the_counted_peaks_stay_inside_the_budget_and_plans_keep_their_prediction(tmp_path, monkeypatch):
    """The GPU run of the report's measurements: torch's peak and the executor's counted gpu peak inside
    `gpu_memory`, prefill and decode timed, and a plan read back from the plan cache still carries the cost
    model's predicted peaks."""
    budget = 6 * 1024**3
    monkeypatch.setenv("LLMOPS_CACHE_DIR", str(tmp_path))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 50_000, (96,), generator=gen).tolist() for _ in range(48)]
    params = SamplingParams(max_new_tokens=8)
    with LLM("opt-1.3b", gpu_memory=budget, cpu_memory="24GiB", trials=2) as llm:
        llm.generate(prompts, params)
        stats, plan = llm.stats.snapshot(), llm.last_plan
    assert 0 < stats.peak_bytes["gpu"] <= budget and 0 < stats.device_peak_bytes <= budget
    assert stats.prefill_s > 0 and stats.decode_s > 0 and stats.plan_s > 0 and stats.generated_tokens == 48 * 8
    peaks = plan.to_dict()["predicted_peak_bytes"]
    assert (plan.source, plan.chosen_by) == ("trials", "trials") and 0 < peaks["gpu"] <= budget
    with LLM("opt-1.3b", gpu_memory=budget, cpu_memory="24GiB") as again:      # no trials: the refined plan stands
        cached = again.plan(prompts, params)
    assert (cached.source, cached.chosen_by) == ("disk", "trials") and cached.to_dict()["predicted_peak_bytes"] == peaks
