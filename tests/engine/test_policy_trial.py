"""The cost model's memory agrees with the executor's own accounting; trials run the real executor."""
from dataclasses import replace

import pytest
import torch

from engine.calibrate import trial as trial_mod
from engine.calibrate.machine import default_cpu_profile
from engine.policy.cost_model import Workload, estimate, rows_filled
from engine.policy.estimate import Budgets
from engine.policy.hardware import reference_profile
from engine.policy.memory import executor_memory
from engine.policy.policy import Policy
from engine.policy.search import search, search_top
from engine.runtime.layout import model_layout
from engine.calibrate.trial import (
    TrialTimes, best_by_trials, extrapolate, per_layer, trial_estimate, trial_prompts, trial_seconds,
    truncated_model,
)
from engine.calibrate.planning.workload import prompts_prefix_len
from engine.runtime.executor import Executor
from engine.runtime.schedule import block_schedule
from helpers.budget_checks import (POLICIES, PREFIXED, WORKLOAD, check_budget_consistency, preset, run_block,
                                   weights_on_disk)
from helpers.greedy_runs import RunToEnd
from helpers.skips import requires_cuda

torch.set_num_threads(1)


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama", "tiny-mixtral", "tiny-deepseek-v2"])
@pytest.mark.parametrize("policy", POLICIES, ids=range(len(POLICIES)))
def test_predicted_memory_is_the_executors_accounting(name, policy, tmp_path):
    check_budget_consistency(name, policy, torch.device("cpu"), default_cpu_profile(), tmp_path)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mixtral"])
@pytest.mark.parametrize("policy", POLICIES, ids=range(len(POLICIES)))
def test_predicted_memory_with_a_shared_prefix_is_the_executors_accounting(name, policy, tmp_path):
    """Rows sharing 5 of 7 tokens (computed once per GPU batch of more than one row): the counted bytes are
    still the executor's, hidden states parked only at decode [g, 1, h] (policy 1 parks a quarter on disk)."""
    check_budget_consistency(name, policy, torch.device("cpu"), default_cpu_profile(), tmp_path, PREFIXED)


def run_ahead_blocks(name, policy, device, disk_dir, workload=WORKLOAD):
    """Two full blocks of `policy` with the ahead prefill on the tiny preset's executor (budgets unlimited):
    its memory report, and whether the second block's prefill ran ahead. With `workload.shared_prefix_len` p
    every prompt starts with the same p tokens, and rows differ right after them."""
    loaded = truncated_model(preset(name), 2, torch.float32)
    ex = Executor(loaded, policy, device=device, dtype=torch.float32, disk_dir=disk_dir)
    try:
        b, flags, p = policy.block_size, [], workload.shared_prefix_len
        blocks = [([[3 + (t if t < p else 7 * r + 5 * t + n) % 50 for t in range(workload.prompt_len)]
                    for r in range(b)], [workload.gen_len] * b, RunToEnd()) for n in range(2)]
        for _ in ex.generate_blocks(blocks):
            flags.append(ex.stats["prefill_ahead"])
        return ex.memory_report(), flags
    finally:
        ex.close()


def check_ahead_memory(name, policy, device, tmp_path, workload=WORKLOAD):
    """The memory model's count with the ahead prefill (two blocks) is the executor's peak, tier by tier, and
    adds to the one-block count exactly what `_ahead_memory` says."""
    ahead = replace(policy, prefill_ahead=True)
    layout = model_layout(preset(name), 4, policy.compress_weights)
    args = (preset(name), layout, ahead, workload.prompt_len, workload.gen_len, 4, device.type)
    kw = dict(shared_prefix_len=workload.shared_prefix_len)
    counted = executor_memory(*args, num_prompts=2 * policy.block_size, **kw)
    alone = executor_memory(*args, num_prompts=policy.block_size, **kw)
    report, flags = run_ahead_blocks(name, ahead, device, tmp_path, workload)
    assert flags == [0.0, 1.0]
    assert counted["cpu"] > alone["cpu"] and counted["gpu"] > alone["gpu"]
    assert report["gpu"]["peak"] == counted["gpu"] and report["cpu"]["peak"] == counted["cpu"]
    assert report["disk"]["peak"] == counted["disk"] - weights_on_disk(preset(name), policy)


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama", "tiny-mixtral"])
@pytest.mark.parametrize("policy", POLICIES, ids=range(len(POLICIES)))
def test_ahead_prefill_memory_is_the_executors_accounting(name, policy, tmp_path):
    check_ahead_memory(name, policy, torch.device("cpu"), tmp_path)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mixtral"])
@pytest.mark.parametrize("policy", POLICIES, ids=range(len(POLICIES)))
def test_ahead_prefill_memory_with_a_shared_prefix_is_the_executors_accounting(name, policy, tmp_path):
    """Rows sharing 5 of 7 tokens: the next block's prefix keys/values on the device and its homes of the
    rows' own positions are counted as the executor holds them."""
    check_ahead_memory(name, policy, torch.device("cpu"), tmp_path, PREFIXED)


@requires_cuda
@pytest.mark.parametrize("policy", POLICIES, ids=range(len(POLICIES)))
@pytest.mark.parametrize("workload", [WORKLOAD, PREFIXED], ids=["plain", "prefixed"])
def test_ahead_prefill_memory_is_the_executors_accounting_on_cuda(policy, workload, tmp_path):
    check_ahead_memory("tiny-llama", policy, torch.device("cuda"), tmp_path, workload)


@requires_cuda
@pytest.mark.parametrize("workload", [WORKLOAD, PREFIXED], ids=["plain", "prefix"])
@pytest.mark.parametrize("policy", POLICIES, ids=range(len(POLICIES)))
def test_predicted_memory_is_the_executors_accounting_on_cuda(policy, workload, tmp_path):
    profile = replace(reference_profile("h200"), device_type="cuda")
    check_budget_consistency("tiny-llama", policy, torch.device("cuda"), profile, tmp_path, workload)


def test_trial_prompts_share_the_workloads_prefix():
    prompts = trial_prompts(preset("tiny-llama"), Workload(20, 4, shared_prefix_len=12), 6)
    assert len(prompts) == 6 and {len(p) for p in prompts} == {20}
    assert prompts_prefix_len(prompts) == 12
    assert prompts_prefix_len(trial_prompts(preset("tiny-llama"), Workload(20, 4), 6)) == 0


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-mixtral"])
def test_searched_policies_fit_the_executor(name, tmp_path):
    """Budgets that force offloading: every policy search_top returns runs within them."""
    config = preset(name)
    profile = default_cpu_profile()
    all_gpu = estimate(config, Policy(gpu_batch_size=4), WORKLOAD, profile, 4,
                       layout=model_layout(config)).peak_memory_bytes["gpu"]
    weights = model_layout(config, 4, False).total_bytes
    budgets = Budgets(gpu_bytes=int((all_gpu - weights // 2) / 0.9), cpu_bytes=64 << 20, disk_bytes=64 << 20)
    found = search_top(config, replace(WORKLOAD, num_prompts=8), budgets, profile, top=3, bytes_per_element=4,
                       gpu_batch_sizes=(1, 2, 4), num_gpu_batches=(1, 2), relax_gpu=0.9, relax_cpu=0.9,
                       layout=model_layout(config))
    assert any(e.policy.w_gpu < 1.0 for e in found)
    for est in found:
        for tier in ("gpu", "cpu"):
            assert est.peak_memory_bytes[tier] <= 0.9 * budgets.of(tier)
        run_block(name, est.policy, torch.device("cpu"), budgets.gpu_bytes, budgets.cpu_bytes, tmp_path)


def test_search_top_is_distinct_sorted_and_starts_with_search():
    config = preset("opt-30b")
    workload = Workload(512, 32, num_prompts=256)
    budgets = Budgets(16 << 30, 100 << 30)
    profile = reference_profile("h200")
    top = search_top(config, workload, budgets, profile, top=4, layout=model_layout(config))
    assert len(top) == 4
    speeds = [e.predicted_tokens_per_s for e in top]
    assert speeds == sorted(speeds, reverse=True)
    assert len({(e.policy.gpu_batch_size, e.policy.num_gpu_batches, e.policy.cpu_attention) for e in top}) == 4
    assert {e.policy.cpu_attention for e in top} == {False, True}       # both kinds reach the trials
    assert top[0].policy == search(config, workload, budgets, profile, layout=model_layout(config)).policy


def test_extrapolation_arithmetic():
    # a 2-layer copy's step of 1.0 s and a 4-layer copy's of 1.6 s: 0.3 s per layer -> 10 layers: 1.0 + 8 * 0.3
    assert per_layer(1.6, 1.0, 4, 2) == pytest.approx(0.3)
    assert extrapolate(1.0, 0.3, 2, 10) == pytest.approx(3.4)
    assert per_layer(0.9, 1.0, 4, 2) == pytest.approx(0.9 / 4)          # noise: the larger copy's step per layer
    config = preset("opt-30b")
    cand = search(config, Workload(512, 32, num_prompts=64), Budgets(16 << 30, 100 << 30), reference_profile("h200"),
                  layout=model_layout(config))
    est = trial_estimate(config, cand, Workload(512, 32), TrialTimes(0.01, 0.02))
    L, b = config.num_hidden_layers, cand.policy.block_size
    assert est.prefill_s == pytest.approx(L * 0.01) and est.decode_s == pytest.approx(L * 31 * 0.02)
    assert est.predicted_tokens_per_s == pytest.approx(b * 32 / (L * 0.01 + L * 31 * 0.02))
    assert est.context["predicted"]["tokens_per_s"] == cand.predicted_tokens_per_s
    assert est.policy == cand.policy


@pytest.mark.parametrize("slack, carried", [(0.0, 0.75), (0.01, 0.75 * (1 - 0.01 * 31 * 2)), (0.5, 0.0)])
def test_extrapolation_of_an_ahead_policy_charges_its_hidden_prefill(slack, carried):
    """A policy with the ahead prefill over 4 blocks: a block pays a quarter of a prefill in series; three blocks
    in four carry the next one's inside their decode, less the search's decode slack (that share of the
    decode's own seconds), never below nothing, and the last carries none; one block, or the flag off: all of
    it in series."""
    config = preset("opt-30b")
    cand = search(config, Workload(512, 32, num_prompts=64), Budgets(16 << 30, 100 << 30), reference_profile("h200"),
                  layout=model_layout(config))
    L, times = config.num_hidden_layers, TrialTimes(0.01, 0.02)
    ahead = replace(cand, policy=replace(cand.policy, prefill_ahead=True),
                    context={**cand.context, "decode_slack": slack})
    rows = 4 * ahead.policy.block_size
    est = trial_estimate(config, ahead, Workload(512, 32, num_prompts=rows), times)
    assert est.prefill_s == pytest.approx(L * 0.01 / 4)
    assert est.decode_s == pytest.approx(L * 31 * 0.02 + L * 0.01 * carried)
    for workload, policy in ((Workload(512, 32, num_prompts=ahead.policy.block_size), ahead.policy),
                             (Workload(512, 32, num_prompts=rows), replace(ahead.policy, prefill_ahead=False))):
        plain = trial_estimate(config, replace(ahead, policy=policy), workload, times)
        assert plain.prefill_s == pytest.approx(L * 0.01) and plain.decode_s == pytest.approx(L * 31 * 0.02)


@pytest.mark.parametrize("num_batches", [1, 3])
def test_layer_clock_times_the_first_decoder_layer_only(num_batches):
    """Inside the clock's window of each step: every GPU batch's compute of the first decoder layer (specs 1
    and 2) and the weight loads issued with them (specs 2 and 3); never the head's load or compute."""
    steps, specs = 3, 2 + 2 * 2                                   # embed, 2 x (attention, mlp), head
    clock = trial_mod._LayerClock(torch.device("cpu"), num_batches, specs)
    seen = []                                                    # (window start, verb, i, j, k)
    for action in block_schedule(steps, specs, num_batches):
        clock(action)
        if action.i in clock.start and action.i not in clock.end:
            seen.append((clock.start[action.i], *action[:4]))
    assert set(clock.layer_s) == set(range(steps))
    inside: dict[str, set] = {"compute": set(), "load_weight": set()}
    for start, verb, i, j, k in seen:
        if start == clock.start[i] and verb in inside:          # only the window that was finally timed
            inside[verb].add((i, j, k))
    for i in range(steps):
        assert {(j, k) for (s, j, k) in inside["compute"] if s == i} == {(j, k) for j in (1, 2)
                                                                       for k in range(num_batches)}
        assert {j for (s, j, k) in inside["load_weight"] if s == i} == {2, 3}


def test_trial_runs_the_real_executor_on_two_truncated_copies(monkeypatch):
    seen = []
    real = Executor.generate_block

    def spy(self, prompts, max_new, select):
        seen.append((self.config.num_hidden_layers, len(prompts), max(max_new)))
        return real(self, prompts, max_new, select)

    monkeypatch.setattr(Executor, "generate_block", spy)
    config = preset("opt-125m")
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, cache_gpu=0.0, cache_cpu=1.0, cpu_attention=True)
    times = trial_seconds(config, policy, Workload(8, 16), "cpu", torch.float32, steps=3)
    # per copy: a warm-up block, then the measured block of 3 decode steps
    assert seen == [(2, 4, 2), (2, 4, 4), (6, 4, 2), (6, 4, 4)]
    assert times.prefill_s_per_layer > 0 and times.decode_s_per_layer_step > 0
    assert [len(times.detail[f"step_s_{n}_layers"]) for n in (2, 6)] == [4, 4]


def test_trial_extrapolates_the_difference_of_the_copies(monkeypatch):
    """Step times a + n * b on an n-layer copy extrapolate to a + L * b: the embedding, head and sampling
    (a) are paid once, each decoder layer (b) L times; a one-off slow decode step is not extrapolated."""
    config = preset("opt-125m")                                  # 12 layers

    def fake_steps(loaded, policy, prompts, steps, device, dtype, **kwargs):
        n = loaded.config.num_hidden_layers
        prefill, decode = 0.5 + n * 0.2, [0.05 + n * 0.01] * steps
        decode[1] *= 3                                           # a stall in one step of each copy
        return [prefill, *decode]

    monkeypatch.setattr(trial_mod, "step_seconds", fake_steps)
    times = trial_seconds(config, Policy(gpu_batch_size=2), Workload(8, 16), "cpu", torch.float32, steps=3)
    L = config.num_hidden_layers
    assert times.prefill_s_per_layer == pytest.approx((0.5 + L * 0.2) / L)
    assert times.decode_s_per_layer_step == pytest.approx((0.05 + L * 0.01) / L)


def test_trial_copies_never_exceed_the_model(monkeypatch):
    config = replace(preset("opt-125m"), num_hidden_layers=4)
    seen = []

    def fake_steps(loaded, policy, prompts, steps, device, dtype, **kwargs):
        n = loaded.config.num_hidden_layers
        seen.append(n)
        return [1.0 + n, *[0.1 + 0.01 * n] * steps]

    monkeypatch.setattr(trial_mod, "step_seconds", fake_steps)
    times = trial_seconds(config, Policy(gpu_batch_size=2), Workload(8, 16), "cpu", torch.float32, steps=3)
    assert seen == [2, 4]
    assert times.decode_s_per_layer_step == pytest.approx((0.1 + 0.04) / 4)   # the 4-layer copy is the model


def test_executor_step_clock_adds_up_to_its_stats():
    loaded = truncated_model(preset("opt-125m"), 2, torch.float32)
    ex = Executor(loaded, Policy(gpu_batch_size=2), device=torch.device("cpu"), dtype=torch.float32)
    try:
        ex.generate_block([[5, 6, 7]] * 2, [4, 4], RunToEnd())
        assert len(ex.step_s) == ex.stats["steps"] == 4
        assert ex.step_s[0] == pytest.approx(ex.stats["prefill_s"])
        assert sum(ex.step_s[1:]) == pytest.approx(ex.stats["decode_s"])
    finally:
        ex.close()


def test_best_by_trials_picks_the_best_measured(monkeypatch):
    config = preset("opt-30b")
    workload = Workload(512, 32, num_prompts=256)
    cands = search_top(config, workload, Budgets(16 << 30, 100 << 30), reference_profile("h200"), top=3,
                       layout=model_layout(config))
    slow_first = {cands[0].policy: TrialTimes(0.05, 0.5)}        # the model's favourite measures worst

    def fake(config_, policy, *args, **kwargs):
        if policy == cands[2].policy:
            raise torch.OutOfMemoryError("trial ran out of memory")
        return slow_first.get(policy, TrialTimes(0.01, 0.01))

    monkeypatch.setattr(trial_mod, "trial_seconds", fake)
    best = best_by_trials(config, cands, workload, "cuda", torch.float16)
    assert best.policy == cands[1].policy
    assert best.context["selected_by"] == "trial"
    log = best.context["trials"]
    assert [t["policy"] for t in log] == [c.policy.to_dict() for c in cands]
    assert log[0]["trial_tokens_per_s"] < log[1]["trial_tokens_per_s"] and "OutOfMemoryError" in log[2]["error"]
    text = best.explain()
    assert "trial" in text and "predicted" in text


def test_trials_are_bounded_by_the_prediction(monkeypatch):
    """A trial faster than the cost model's optimistic bound counts as the bound: the candidate predicted
    faster wins over one whose trial merely read faster; a trial below its prediction keeps its numbers."""
    config = preset("opt-30b")
    workload = Workload(512, 32, num_prompts=256)
    cands = search_top(config, workload, Budgets(16 << 30, 100 << 30), reference_profile("h200"), top=3,
                       layout=model_layout(config))
    first, second, third = (c.predicted_tokens_per_s for c in cands)
    assert first > second >= third
    wanted = {cands[0].policy: 1.2 * first, cands[1].policy: 3.0 * second, cands[2].policy: 0.5 * third}

    def fake(config_, policy, *args, **kwargs):
        # decode-only times that extrapolate to exactly the wanted tokens/s over the run's rows
        b = policy.block_size
        decode_s = rows_filled(b, workload.num_prompts) * b * workload.gen_len / wanted[policy]
        return TrialTimes(0.0, decode_s / (config.num_hidden_layers * (workload.gen_len - 1)))

    monkeypatch.setattr(trial_mod, "trial_seconds", fake)
    best = best_by_trials(config, cands, workload, "cuda", torch.float16)
    assert best.policy == cands[0].policy
    assert best.predicted_tokens_per_s == pytest.approx(first)            # the bound, not the trial's 1.2x
    assert best.context["trial"]["bounded_by_model"] is True
    assert "cost model's" in best.explain()
    log = best.context["trials"]
    assert log[1]["trial_tokens_per_s"] == pytest.approx(3.0 * second)
    assert log[1]["score_tokens_per_s"] == pytest.approx(second)
    assert log[2]["score_tokens_per_s"] == pytest.approx(0.5 * third)   # below the bound: the trial's own
