"""The executor on the CPU: greedy parity with transformers, per-row limits, budgets, compression, reuse."""
from __future__ import annotations

import pytest
import torch

from engine.models.loader import load_model
from engine.policy.policy import Policy
from engine.runtime.executor import Executor
from engine.storage import BudgetExceeded
from helpers.greedy_runs import GreedyRecorder, make_prompts, run_policy


def _hf_greedy(model, prompt, n):
    """Greedy continuation by full transformers forwards (no EOS handling: every token is an argmax)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("kind", ["llama", "opt", "mixtral"])
def test_greedy_matches_transformers(tiny_checkpoints, kind):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints[kind], dtype=torch.float32).eval()
    loaded = load_model(tiny_checkpoints[kind], dtype=torch.float32)
    prompts = make_prompts(8, loaded.config.vocab_size, seed=11, lo=2, hi=40)
    assert len({len(p) for p in prompts}) >= 6
    tokens, _ = run_policy(loaded, Policy(gpu_batch_size=8), prompts, [10] * 8)
    with torch.inference_mode():
        for r, p in enumerate(prompts):
            assert tokens[r] == _hf_greedy(hf, p, 10), f"row {r} (prompt length {len(p)})"


@pytest.mark.parametrize("kind", ["llama", "opt", "mixtral"])
def test_shared_prefix_matches_transformers(tiny_checkpoints, kind):
    """Prompts sharing a system-prompt-like prefix: the prefix is computed once per GPU batch."""
    import transformers

    from engine.runtime.batch import shared_prefix_len

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints[kind], dtype=torch.float32).eval()
    loaded = load_model(tiny_checkpoints[kind], dtype=torch.float32)
    prefix = make_prompts(1, loaded.config.vocab_size, seed=12, lo=9, hi=10)[0]
    prompts = [prefix + p for p in make_prompts(6, loaded.config.vocab_size, seed=13, lo=1, hi=12)]
    assert shared_prefix_len(prompts) >= 9
    tokens, _ = run_policy(loaded, Policy(gpu_batch_size=3, num_gpu_batches=2), prompts, [6] * 6)
    with torch.inference_mode():
        for r, p in enumerate(prompts):
            assert tokens[r] == _hf_greedy(hf, p, 6), f"row {r}"


def test_shared_prefix_len():
    from engine.runtime.batch import shared_prefix_len

    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9]]) == 2
    assert shared_prefix_len([[1, 2], [1, 2]]) == 1                           # one own token is kept per row
    assert shared_prefix_len([[1], [2]]) == 0


def test_bf16_runs_and_mostly_agrees(tiny_checkpoints):
    loaded32 = load_model(tiny_checkpoints["llama"], dtype=torch.float32)
    prompts = make_prompts(8, loaded32.config.vocab_size, seed=2)
    ref, _ = run_policy(loaded32, Policy(gpu_batch_size=8), prompts, [5] * 8)
    got, _ = run_policy(load_model(tiny_checkpoints["llama"], dtype=torch.bfloat16), Policy(gpu_batch_size=8),
                        prompts, [5] * 8, dtype=torch.bfloat16)
    assert sum(got[r][0] == ref[r][0] for r in range(8)) >= 6


def test_per_row_limits_and_selector_finish(tiny_checkpoints):
    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.float32)
    prompts = make_prompts(6, loaded.config.vocab_size, seed=4)
    max_new = [1, 4, 2, 7, 3, 5]
    tokens, _ = run_policy(loaded, Policy(gpu_batch_size=4, num_gpu_batches=2), prompts, max_new)
    assert [len(tokens[r]) for r in range(6)] == max_new
    stop = tokens[3][2]
    stopped, _ = run_policy(loaded, Policy(gpu_batch_size=4, num_gpu_batches=2), prompts, max_new, stop_ids=(stop,))
    assert stopped[3] == tokens[3][:tokens[3].index(stop) + 1]


def test_rejects_bad_blocks(tiny_checkpoints):
    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.float32)
    ex = Executor(loaded, Policy(gpu_batch_size=2), device=torch.device("cpu"), dtype=torch.float32)
    try:
        with pytest.raises(ValueError, match="block size 2"):
            ex.generate_block([[5], [6], [7]], [1, 1, 1], GreedyRecorder())
        with pytest.raises(ValueError, match="row 1"):
            ex.generate_block([[5], []], [1, 1], GreedyRecorder())
        ex.generate_block([], [], GreedyRecorder())
    finally:
        ex.close()


def test_gpu_budget_fails_fast_with_a_clear_message(tiny_checkpoints):
    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.float32)
    with pytest.raises(BudgetExceeded, match="gpu memory budget exceeded: home.*weight"):
        Executor(loaded, Policy(), device=torch.device("cpu"), dtype=torch.float32, gpu_memory=10_000)
    ex = Executor(loaded, Policy(w_gpu=0.0, w_cpu=1.0, gpu_batch_size=64), device=torch.device("cpu"),
                  dtype=torch.float32, gpu_memory=32 << 20)
    try:
        with pytest.raises(BudgetExceeded, match="gpu memory budget exceeded"):
            ex.generate_block([[5 + r] * 200 for r in range(64)], [50] * 64, GreedyRecorder())   # no shared prefix
        ex.generate_block([[5, 6, 7]] * 2, [3, 3], GreedyRecorder())       # a small block still fits
        assert ex.memory_report()["gpu"]["peak"] <= 32 << 20
    finally:
        ex.close()


class _FirstLogits(GreedyRecorder):
    def __call__(self, rows, logits):
        if self.calls == 0:
            self.first = logits.clone()
        return super().__call__(rows, logits)


@pytest.mark.parametrize("flags", [dict(compress_weights=True), dict(compress_cache=True),
                                   dict(compress_weights=True, compress_cache=True, cache_gpu=0.0, cache_cpu=1.0,
                                        w_gpu=0.5, w_cpu=0.5)])
def test_compression_stays_close(tiny_checkpoints, flags):
    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.float32)
    prompts = make_prompts(4, loaded.config.vocab_size, seed=6)
    results = []
    for policy in (Policy(gpu_batch_size=4), Policy(gpu_batch_size=4, **flags)):
        ex = Executor(loaded, policy, device=torch.device("cpu"), dtype=torch.float32)
        sel = _FirstLogits()
        ex.generate_block(prompts, [4] * 4, sel)
        ex.close()
        results.append(sel)
    ref, got = results[0].first, results[1].first
    assert torch.isfinite(got).all()
    assert (got - ref).norm() / ref.norm() < 0.15
    assert results[1].tokens.keys() == results[0].tokens.keys()


def test_disk_weights_built_once_and_reused(tiny_checkpoints, tmp_path):
    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.float32)
    policy = Policy(w_gpu=0.0, w_cpu=0.0, compress_weights=True)
    first = Executor(loaded, policy, device=torch.device("cpu"), dtype=torch.float32, disk_dir=tmp_path)
    assert first.weights.files is not None and len(first.weights.files.rebuilt) > 0
    first.close()
    second = Executor(loaded, policy, device=torch.device("cpu"), dtype=torch.float32, disk_dir=tmp_path)
    assert second.weights.files.rebuilt == []
    second.close()


def test_hook_sees_the_one_loop(tiny_checkpoints):
    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.float32)
    seen = []
    prompts = make_prompts(4, loaded.config.vocab_size, seed=8)
    run_policy(loaded, Policy(gpu_batch_size=2, num_gpu_batches=2), prompts, [2] * 4,
               hook=lambda a: seen.append(a.verb))
    n_layers = len(loaded.family.layer_specs())
    assert seen.count("compute") == 2 * n_layers * 2
    assert {"load_weight", "load_cache", "store_cache", "sync"} <= set(seen)


def test_close_frees_every_buffer_without_the_cyclic_gc(tiny_checkpoints):
    """After close() the executor holds no tensor: its buffers die at once even while it is referenced and the
    cyclic GC is off (a self-referencing executor kept a whole model's device weights alive across runs)."""
    import gc
    import weakref

    loaded = load_model(tiny_checkpoints["opt"], dtype=torch.float32)
    ex = Executor(loaded, Policy(gpu_batch_size=2, num_gpu_batches=2), device=torch.device("cpu"),
                  dtype=torch.float32)
    ex.generate_block(make_prompts(4, loaded.config.vocab_size), [3] * 4, GreedyRecorder())
    refs = [weakref.ref(flat) for _, flat in ex.arena._flat.values()]
    assert len(refs) > 4 and all(r() is not None for r in refs)
    gc.disable()
    try:
        ex.close()
        assert [r for r in refs if r() is not None] == []
    finally:
        gc.enable()


class _Recorded:
    """A stand-in for a transfer's Pending that records whether it was waited for."""

    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> None:
        self.waited = True


def test_staging_claims_wait_for_the_buffers_previous_store_only():
    from engine.runtime.kv_buffers import StagingClaims

    claims = StagingClaims()
    first, other = _Recorded(), _Recorded()
    claims.record("kvstage0.s0", first)
    claims.record("kvstage1.s0", other)
    claims.claim("kvstage0.s0")
    assert first.waited and not other.waited
    again = _Recorded()
    claims.claim("kvstage0.s0")                       # nothing recorded since: nothing to wait for
    claims.record("kvstage0.s0", again)
    assert not again.waited


@pytest.mark.parametrize("layers, batches, slots", [(1, 2, 2), (32, 2, 16)])
def test_decode_stores_stage_through_their_own_ring(layers, batches, slots):
    """On CUDA a decode step's cache stores take `decode_stage_slots` staging sets in turn (keys and values
    [g, heads, 1, hd] each: up to 16, fewer when a step stores less), counted alike by the executor's
    accounting and the LP's terms; with CPU attention (the host writes its homes) or no decode step, none."""
    from dataclasses import replace

    from engine.models.hf_config import config_from_hf
    from engine.models.presets import PRESETS
    from engine.policy.cost_model import Workload, estimate
    from engine.policy.hardware import reference_profile
    from engine.policy.buffers import decode_stage_slots
    from engine.policy.dtypes import stored_nbytes
    from engine.policy.memory import executor_memory
    from engine.quant.config import CACHE_QUANT
    from engine.runtime.layout import model_layout

    config = replace(config_from_hf(PRESETS["llama-3-70b"]), num_hidden_layers=layers)
    layout = model_layout(config, 2, True)
    policy = Policy(gpu_batch_size=96, num_gpu_batches=batches, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.0,
                    cache_cpu=1.0, compress_weights=True, compress_cache=True)
    assert decode_stage_slots(layers * batches) == slots

    def cpu(pol, gen_len):
        return executor_memory(config, layout, pol, 200, gen_len, 2, "cuda")["cpu"]
    host_attention = replace(policy, cpu_attention=True)
    ring = slots * 2 * stored_nbytes((96, config.num_key_value_heads, 1, config.head_dim), "float16", CACHE_QUANT)
    assert cpu(policy, 10) - cpu(host_attention, 10) == ring
    assert cpu(policy, 1) == cpu(host_attention, 1)
    assert estimate(config, policy, Workload(200, 10), reference_profile("h200"),
                    layout=layout).peak_memory_bytes["cpu"] == cpu(policy, 10)


def test_host_side_store_completes_inline_without_cuda():
    """Without CUDA, `submit_host` runs the copy and the host work before returning (nothing to overlap)."""
    from engine.runtime.transfers import Transfers

    transfers = Transfers(torch.device("cpu"), overlap=True)
    src, dst, order = torch.arange(4.0), torch.zeros(4), []

    def fn(stream):
        order.append("copy")
        return None

    def then():
        order.append("then")
        dst.copy_(src)
    pending = transfers.submit_host("store", fn, then)
    assert order == ["copy", "then"] and pending.done and torch.equal(dst, src)
    pending.wait()
    transfers.close()


class _StepEvents(GreedyRecorder):
    """GreedyRecorder that logs each choice (its rows) and each `end_step` call, in order."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[int, ...] | None] = []

    def __call__(self, rows, logits):
        self.events.append(tuple(rows))
        return super().__call__(rows, logits)

    def end_step(self):
        self.events.append(None)


def test_end_step_follows_the_last_running_batch_of_each_step(tiny_checkpoints):
    """A selector's `end_step` runs once per step, after every GPU batch still running has chosen: three GPU
    batches of two rows, the last one ending after its first token, so later steps end after batch 1."""
    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.float32)
    prompts = make_prompts(6, loaded.config.vocab_size, seed=4)
    sel = _StepEvents()
    ex = Executor(loaded, Policy(gpu_batch_size=2, num_gpu_batches=3), device=torch.device("cpu"),
                  dtype=torch.float32)
    try:
        ex.generate_block(prompts, [4, 4, 4, 4, 1, 1], sel)
    finally:
        ex.close()
    steps, current = [], []
    for event in sel.events:
        if event is None:
            steps.append(current)
            current = []
        else:
            current.append(event)
    assert current == []                                     # no choice after the last end_step
    assert steps[0] == [(0, 1), (2, 3), (4, 5)]
    assert steps[1:] == [[(0, 1), (2, 3)]] * 3
