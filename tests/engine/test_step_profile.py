"""The per-layer step profile: a hook on the executor's one loop that names every layer and accounts for the
step time (CPU, fp32; the same tokens as an unprofiled run)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.calibrate.trial import truncated_model
from engine.models.hf_config import config_from_hf
from engine.models.presets import PRESETS
from engine.policy.policy import Policy
from engine.runtime.executor import Executor
from engine.runtime.step_profile import PARTS, StepProfile
from helpers.greedy_runs import GreedyRecorder


def run(policy: Policy, profiled: bool):
    config = replace(config_from_hf(PRESETS["tiny-llama"]), hidden_size=256, intermediate_size=768, head_dim=64)
    loaded = truncated_model(config, 3, torch.float32)
    ex = Executor(loaded, policy, device=torch.device("cpu"), dtype=torch.float32)
    try:
        prof = StepProfile(ex.device, [s.kind for s in ex.specs]) if profiled else None
        ex.profiler = prof
        sel = GreedyRecorder()
        prompts = [[3 + (r * 5 + t) % 300 for t in range(48)] for r in range(policy.block_size)]
        ex.generate_block(prompts, [5] * policy.block_size, sel)
        return sel.tokens, prof, dict(ex.stats), [s.kind for s in ex.specs]
    finally:
        ex.close()


@pytest.mark.parametrize("flags", [dict(), dict(w_gpu=0.0, w_cpu=1.0, compress_weights=True, cache_gpu=0.0,
                                                cache_cpu=1.0, compress_cache=True, cpu_attention=True)],
                         ids=["resident", "offloaded"])
def test_profile_names_every_layer_and_sums_to_the_step_time(flags):
    policy = Policy(gpu_batch_size=4, num_gpu_batches=2, **flags)
    tokens, prof, stats, kinds = run(policy, True)
    report = prof.report()
    assert report["prefill"]["steps"] == 1 and report["decode"]["steps"] == 4
    for phase in ("prefill", "decode"):
        r = report[phase]
        assert [row["kind"] for row in r["layers"]] == kinds
        assert [row["j"] for row in r["layers"]] == list(range(len(kinds)))
        assert all(f"{p}_s" in row for row in r["layers"] for p in PARTS)
        inside = sum(r["parts_s"].values())
        assert inside <= r["step_s"] * (1 + 1e-6) + 1e-9                # the parts fit inside the step
        assert inside >= 0.5 * r["step_s"]
        assert sum(row["compute_s"] for row in r["layers"]) > 0
    total = report["prefill"]["step_s"] + report["decode"]["step_s"]
    assert total == pytest.approx(stats["prefill_s"] + stats["decode_s"], rel=0.25)
    assert tokens == run(policy, False)[0]
