"""The buffer plan (`engine.policy.buffers`): what the executor allocates is the plan, name for name and byte for
byte, for every family and a grid of policies; the memory model's peak is the plan's sum plus the working
memory; the arena refuses a buffer the plan does not hold; the LP's affine memory is the plan at realized
placements."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.models.hf_config import config_from_hf
from engine.models.presets import PRESETS
from engine.policy.affine import evaluate
from engine.policy.buffer_spec import BatchShape, BlockShape, BufferPlan, BufferSpec
from engine.policy.buffers import ahead_pass_rows, ahead_passes, buffer_plan
from engine.policy.dtypes import quant_parts, stored_nbytes
from engine.policy.memory import (
    executor_memory, executor_plan, executor_working_bytes, memory_terms, peak_memory, realized_placement,
)
from engine.policy.policy import Policy
from engine.quant.config import CACHE_QUANT
from engine.runtime.arena import Arena, PlanViolation
from engine.runtime.layout import model_layout
from engine.storage.tiers import MemoryBudget, Tier
from helpers.buffer_plans import FAMILIES, GRID, differences, family, planned, run, weight_file_bytes

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("case", sorted(GRID))
def test_the_executor_allocates_the_plan(name, case, tmp_path):
    """Every buffer the executor's arena holds after its blocks is one the memory model plans, of the planned
    tier, shape, dtype, grouping and bytes, and every planned buffer was allocated; the budgets' peaks are the
    memory model's bytes (the disk's less the weight files, which are mapped, not scratch)."""
    policy, prefix, blocks = GRID[case]
    loaded = family(name)
    held, asked, report = run(loaded, policy, prefix, blocks, CPU, tmp_path)
    plan, memory, _ = planned(loaded, policy, prefix, blocks, "cpu")
    assert differences(held, asked, plan) == []
    assert report["gpu"]["peak"] == memory["gpu"] and report["cpu"]["peak"] == memory["cpu"]
    assert report["disk"]["peak"] == memory["disk"] - weight_file_bytes(plan)


@pytest.mark.parametrize("name", ["llama", "opt"])
@pytest.mark.parametrize("compress", [False, True], ids=["onednn", "int4"])
def test_a_cpu_run_holds_its_packed_weights_as_planned(name, compress, tmp_path):
    """A bfloat16 CPU run holds its matmul weights packed (`engine.models.cpu_linear`): the int4 kernel's
    operands are planned buffers beside their 4-bit homes, a oneDNN-reordered weight is held in place of its
    home; what the arena holds and the budgets' peaks are still the plan's."""
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu=0.5, w_cpu=0.5, compress_weights=compress)
    loaded = family(name, dtype=torch.bfloat16)
    held, asked, report = run(loaded, policy, 0, 1, CPU, tmp_path, torch.bfloat16)
    plan, memory, _ = planned(loaded, policy, 0, 1, "cpu", 2, dtype=torch.bfloat16)
    assert differences(held, asked, plan) == []
    assert report["gpu"]["peak"] == memory["gpu"] and report["cpu"]["peak"] == memory["cpu"]
    packed = [n for n in plan if n.startswith("packed.")]
    assert bool(packed) == compress and {plan[n].tier for n in packed} <= {"gpu", "cpu"}


def test_the_memory_model_is_the_plan_sum_plus_working_memory():
    """`executor_memory` counts no buffer itself: per tier the plan's bytes, and on the gpu the working memory."""
    loaded = family("mixtral")
    layout = model_layout(loaded.config, 4, True)
    policy = Policy(gpu_batch_size=4, num_gpu_batches=2, w_gpu=0.0, w_cpu=0.5, cache_gpu=0.5, cache_cpu=0.5,
                    compress_weights=True, prefill_ahead=True)
    args = (loaded.config, layout, policy, 40, 8, 4, "cuda")
    kw = dict(shared_prefix_len=0, num_prompts=64)
    plan = executor_plan(*args, **kw)
    memory = executor_memory(*args, **kw)
    on = plan.bytes_on()
    assert memory == {"gpu": on["gpu"] + executor_working_bytes(*args, **kw), "cpu": on["cpu"], "disk": on["disk"]}
    owners = {spec.owner for spec in plan.entries}
    assert {"weights", "weight files", "weight loads", "weight relays", "dequantized weights", "cache homes",
            "cache loads", "cache stores"} <= owners
    assert sum(spec.total for spec in plan.entries) == sum(plan.buffers()[n].nbytes for n in plan.buffers())


def test_a_4bit_buffer_is_its_codes_mins_and_scales():
    spec = BufferSpec("kv.{}.{}.s0.k", "cpu", (3, 2, 10, 64), "bfloat16", "cache homes", CACHE_QUANT,
                      ((1, 3), (0, 1, 2)))
    parts = quant_parts(spec.shape, spec.dtype, CACHE_QUANT)
    assert [(name, dtype) for name, _, dtype in parts] == [("data", "uint8"), ("mn", "float16"),
                                                            ("scale", "float16")]
    assert spec.nbytes == 3 * 2 * 10 * (32 + 2 + 2) == stored_nbytes(spec.shape, "bfloat16", CACHE_QUANT)
    assert spec.count == 6 and spec.total == 6 * spec.nbytes
    assert list(spec.names())[:2] == ["kv.1.0.s0.k", "kv.1.1.s0.k"]


def test_plans_merge_a_shared_buffer_at_its_largest_use():
    small = BufferSpec("kvbuf0.s1.k", "gpu", (2, 1, 9, 16), "float32", "cache loads")
    large = BufferSpec("kvbuf0.s1.k", "gpu", (3, 1, 9, 16), "float32", "cache loads")
    plan = BufferPlan((small,)) + BufferPlan((large,))
    assert plan.entries == (large,) and plan.bytes_on()["gpu"] == large.nbytes


@pytest.mark.parametrize("rows", [[3, 3], [4, 4, 4], [5, 2, 7], [1], [6, 6, 1]])
@pytest.mark.parametrize("per_pass", [1, 2, 3, 4, 5, 8, 20])
def test_ahead_pass_rows_are_the_passes(rows, per_pass):
    """The plan's closed form for the most rows of each GPU batch one ahead pass holds is the passes' own."""
    passes = ahead_passes(rows, per_pass)
    assert [n for part in passes for _, _, n in part] and sum(n for part in passes for _, _, n in part) == sum(rows)
    assert all(sum(n for _, _, n in part) <= per_pass for part in passes)
    most = [max(n for part in passes for k, _, n in part if k == kk) for kk in range(len(rows))]
    assert ahead_pass_rows(rows, per_pass) == most


def test_a_block_plan_follows_its_batches():
    """The executor's block plan is per GPU batch: a short last batch plans smaller homes, and a shared buffer
    (the decode's device copy of a loaded segment) is planned at the largest batch."""
    loaded = family("llama")
    layout = model_layout(loaded.config, 4, False)
    policy = Policy(gpu_batch_size=4, num_gpu_batches=2, cache_gpu=0.0, cache_cpu=0.0)
    block = BlockShape((BatchShape(4, 12, 20), BatchShape(1, 6, 14)), steps=9)
    buffers = buffer_plan(loaded.config, layout, policy, block, "cpu").buffers()
    assert buffers["kv.1.0.s0.k"].shape == (4, 2, 20, 16) and buffers["kv.1.1.s0.k"].shape == (1, 2, 14, 16)
    assert buffers["kvbuf0.s0.k"].shape == (4, 2, 20, 16)


def test_the_arena_hands_out_only_the_plan():
    """A planned buffer comes at its planned size (a smaller request is a view of it); a name outside the
    plan, another tier or more bytes than planned raise `PlanViolation`, naming the buffer."""
    arena = Arena(CPU, MemoryBudget({t: None for t in Tier}), None)
    arena.plan(BufferPlan((BufferSpec("act.{}.1", "gpu", (2, 8, 16), "float32", "hidden homes", None, ((0, 1),)),)))
    view = arena.get("act.1.1", Tier.GPU, (1, 8, 16), torch.float32)
    assert view.shape == (1, 8, 16) and arena.budget.used[Tier.GPU] == 2 * 8 * 16 * 4
    assert arena.held["act.1.1"].shape == (2, 8, 16)
    with pytest.raises(PlanViolation, match="act.2.1"):
        arena.get("act.2.1", Tier.GPU, (1, 8, 16), torch.float32)
    with pytest.raises(PlanViolation, match="act.0.1.*planned gpu"):
        arena.get("act.0.1", Tier.CPU, (2, 8, 16), torch.float32)
    with pytest.raises(PlanViolation, match="act.0.1"):
        arena.get("act.0.1", Tier.GPU, (3, 8, 16), torch.float32)
    arena.close()


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("flags", [dict(), dict(compress_cache=True, cpu_attention=True),
                                   dict(compress_weights=True, prefill_ahead=True)])
def test_the_lps_memory_is_the_plan_at_realized_placements(device_type, flags):
    """`memory_terms` (the LP's affine memory, read off the plan at each class's vertices) equals `peak_memory`
    at placements that split the cache along kv heads and the hidden states along features, with the weights
    wholly on one tier (between tiers whole tensors make the plan a step function)."""
    loaded = family("mixtral", layers=3)
    config = loaded.config
    layout = model_layout(config, 2, flags.get("compress_weights", False))
    for w in ((1.0, 0.0), (0.0, 1.0), (0.0, 0.0)):
        for cache in ((1.0, 0.0), (0.5, 0.5), (0.0, 0.5), (0.5, 0.0)):
            for act in ((1.0, 0.0), (0.5, 0.25)):
                policy = Policy(gpu_batch_size=3, num_gpu_batches=3, w_gpu=w[0], w_cpu=w[1], cache_gpu=cache[0],
                                cache_cpu=cache[1], act_gpu=act[0], act_cpu=act[1], **flags)
                args = (config, layout, policy, 24, 6, 2, device_type)
                exact = peak_memory(*args, shared_prefix_len=0, num_prompts=None)
                terms = memory_terms(*args, shared_prefix_len=0, num_prompts=None)
                x = realized_placement(config, layout, policy, device_type)
                got = {t: evaluate(terms[t], x) for t in exact}
                assert got == pytest.approx(exact, rel=1e-9, abs=1.0), (policy, got, exact)


def test_the_plan_knows_no_torch():
    """The plan is data: dtypes are names, and a plan of a 70B-parameter model is a few hundred entries."""
    config = config_from_hf(PRESETS["llama-3-70b"])
    layout = model_layout(config, 2, True)
    policy = Policy(gpu_batch_size=64, num_gpu_batches=8, w_gpu=0.2, w_cpu=0.8, cache_gpu=0.25, cache_cpu=0.75,
                    compress_weights=True, compress_cache=True)
    plan = executor_plan(config, layout, policy, 512, 32, 2, "cuda", num_prompts=None)
    assert len(plan.entries) < 500 and all(isinstance(s.dtype, str) for s in plan.entries)
    kv = [s for s in plan.entries if s.name.startswith("kv.{}.{}.s0")]
    assert kv and all(s.count == 80 * 8 for s in kv)
    assert np.isclose(sum(s.total for s in plan.entries), sum(plan.bytes_on().values()))
