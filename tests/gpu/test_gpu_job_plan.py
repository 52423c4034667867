"""On CUDA: planning (search + trials) and every later call stay inside `gpu_memory`, the plan is chosen
once per bucket and comes from the disk plan cache in a new engine; a preview there shows the plan the run's
trials chose (skipped without a GPU)."""
from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.storage import device_cap
from helpers.skips import requires_cuda

pytestmark = requires_cuda

BUDGET = 6 * 1024**3


def test_auto_planning_and_calls_stay_inside_the_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPS_CACHE_DIR", str(tmp_path))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    llm = LLM("opt-1.3b", gpu_memory=BUDGET, cpu_memory="24GiB", trials=4)
    assert device_cap.cap_bytes(llm.device) == BUDGET
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 50_000, (96,), generator=gen).tolist() for _ in range(48)]
    params = SamplingParams(max_new_tokens=8)
    out = llm.generate(prompts, params)
    first = llm.last_plan
    assert first.source == "trials" and all(c.finish_reason == "length" for c in out)
    llm.generate(prompts[:20], params)
    llm.generate(prompts[:40], params, plan=first)
    assert llm.last_plan is first
    assert torch.cuda.max_memory_reserved() <= BUDGET
    llm.close()
    del llm
    again = LLM("opt-1.3b", gpu_memory=BUDGET, cpu_memory="24GiB")
    plan = again.plan(prompts, params)
    preview = again.plan(prompts, params, measure=False)
    assert plan.source == "disk" and plan.policy == first.policy and plan.chosen_by == "trials"
    assert preview.policy == first.policy and preview.pending_trials == 0
