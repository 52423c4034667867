"""Pipeline parallelism: the torch-free stage partition and micro-batch schedule, and a pipeline of stages on
CPU "devices" giving the same greedy tokens as one executor, under several offloading policies."""
from __future__ import annotations

import pytest
import torch

from engine.models.loader import load_model
from engine.policy.partition import Stage, balanced_split, partition_model
from engine.policy.policy import Policy
from engine.runtime.pipeline import Pipeline
from engine.runtime.pipeline_schedule import Task, simulate, source, stage_order, utilization
from engine.runtime.stage_executor import StageExecutor
from helpers.greedy_runs import GreedyRecorder, make_prompts
from helpers.stage_pipeline import POLICIES, micro_blocks, one_executor, pipeline_tokens
from helpers.tiny_checkpoints import TINY_CONFIGS


# ---- partition --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("costs, stages, extra, expect", [
    ([1] * 8, 2, (0, 0), [range(0, 4), range(4, 8)]),
    ([1] * 8, 4, (0, 0), [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]),
    ([1] * 8, 2, (2, 0), [range(0, 3), range(3, 8)]),         # the embedding weighs 2 layers
    ([1] * 9, 3, (0, 3), [range(0, 4), range(4, 8), range(8, 9)]),
    ([5, 1, 1, 1, 1, 1], 2, (0, 0), [range(0, 1), range(1, 6)]),
    ([1] * 3, 1, (7, 7), [range(0, 3)]),
])
def test_balanced_split(costs, stages, extra, expect):
    assert balanced_split(costs, stages, first_extra=extra[0], last_extra=extra[1]) == expect


def test_balanced_split_is_optimal():
    """Against every cut of 7 layers into 3 stages: no split has a lighter heaviest stage."""
    costs, fe, le = [3, 1, 4, 1, 5, 9, 2], 2.0, 6.0

    def worst(rs):
        return max(sum(costs[r.start:r.stop]) + (fe if s == 0 else 0) + (le if s == 2 else 0) for s, r in enumerate(rs))
    best = min(worst([range(0, a), range(a, b), range(b, 7)]) for a in range(1, 6) for b in range(a + 1, 7))
    got = balanced_split(costs, 3, first_extra=fe, last_extra=le)
    assert [r.start for r in got] == [0, got[1].start, got[2].start] and got[-1].stop == 7
    assert worst(got) == best


def test_balanced_split_rejects_bad_counts():
    with pytest.raises(ValueError, match="3 stages for 2 layers"):
        balanced_split([1, 1], 3)
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        balanced_split([1, 1], 0)


def test_partition_model_covers_every_layer(tiny_checkpoints):
    config = load_model(tiny_checkpoints["opt"], dtype=torch.float32).config
    stages = partition_model(config, 2, 2, compress=False)
    assert [s.index for s in stages] == [0, 1] and stages[0].first and stages[-1].last
    assert not stages[0].last and not stages[1].first
    assert [layer for s in stages for layer in s.layers] == list(range(config.num_hidden_layers))
    assert stages[0].holds("embed", -1) and not stages[1].holds("embed", -1) and stages[1].holds("head", -1)


# ---- schedule ---------------------------------------------------------------------------------------------
def test_stage_order_and_sources():
    assert stage_order(2, 2) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert source(Task(0, 0, 1), 3) is None
    assert source(Task(2, 1, 0), 3) == Task(1, 1, 0)
    assert source(Task(0, 1, 1), 3) == Task(2, 0, 1)


@pytest.mark.parametrize("stages, micro", [(2, 2), (3, 2), (2, 4), (4, 4), (3, 1)])
def test_simulated_tasks_follow_their_sources(stages, micro):
    times = simulate(stages, 5, micro)
    assert len(times) == stages * 5 * micro
    for task, (start, end) in times.items():
        src = source(task, stages)
        assert end == start + 1
        if src is not None:
            assert times[src][1] <= start
    for s in range(stages):                   # a stage runs one task at a time, in its order
        spans = [times[Task(s, i, m)] for i, m in stage_order(5, micro)]
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_enough_micro_batches_keep_every_stage_busy():
    assert utilization(2, 64, 2) > 0.99
    assert utilization(4, 64, 4) > 0.98
    assert utilization(2, 64, 1) == pytest.approx(0.5, abs=0.01)   # one micro-batch: the stages take turns
    assert utilization(4, 64, 2) == pytest.approx(0.5, abs=0.01)


# ---- a pipeline on CPU "devices" --------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("kind", ["llama", "opt", "mixtral"])
def test_two_stages_matchone_executor(tiny_checkpoints, tmp_path, kind, name):
    loaded = load_model(tiny_checkpoints[kind], dtype=torch.float32)
    policy = Policy(**{"gpu_batch_size": 2, "num_gpu_batches": 2, **POLICIES[name]})
    prompts = make_prompts(9, loaded.config.vocab_size, seed=5)
    max_new = [6, 9, 3, 9, 7, 9, 5, 9, 8]
    blocks = micro_blocks(prompts, max_new, policy.block_size)       # 3 micro-batches: 4, 4 and 1 rows
    want = one_executor(loaded, policy, blocks, (), tmp_path / "one")
    got = pipeline_tokens(loaded, policy, blocks, (), tmp_path / "pipe", ["cpu", "cpu"])
    assert got == want
    assert [len(t) for b in got for _, t in sorted(b.items())] == max_new


@pytest.fixture(scope="module")
def four_layer_llama(tmp_path_factory):
    """The tiny Llama with 4 decoder layers (3 stages need 3 layers; the middle stage only relays)."""
    import transformers

    spec = {**TINY_CONFIGS["llama"], "num_hidden_layers": 4}
    config = getattr(transformers, spec.pop("cls"))(**spec)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama4")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("stages", [2, 3])
def test_stages_with_early_stops_match(four_layer_llama, tmp_path, stages):
    """Rows ending on a stop token at different steps (so batches compact and a micro-batch ends early)."""
    loaded = load_model(four_layer_llama, dtype=torch.float32)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2)
    prompts = make_prompts(10, loaded.config.vocab_size, seed=8)
    max_new = [12] * 10
    blocks = micro_blocks(prompts, max_new, policy.block_size)
    plain = one_executor(loaded, policy, blocks, (), tmp_path / "plain")
    stop = (plain[0][0][2], plain[1][1][4])                          # tokens some rows emit mid-way
    want = one_executor(loaded, policy, blocks, stop, tmp_path / "one")
    assert any(len(t) < 12 for b in want for t in b.values())
    got = pipeline_tokens(loaded, policy, blocks, stop, tmp_path / "pipe", ["cpu"] * stages)
    assert got == want


def test_a_failing_stage_stops_the_pipeline(tiny_checkpoints, tmp_path):
    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.float32)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=1)
    prompts = make_prompts(4, loaded.config.vocab_size, seed=2)

    def broken(rows, logits):
        raise RuntimeError("selector failed")
    stages = partition_model(loaded.config, 2, 4, compress=False)
    pipe = Pipeline([StageExecutor(loaded, policy, st, device=torch.device("cpu"), dtype=torch.float32)
                     for st in stages])
    try:
        with pytest.raises(RuntimeError, match="selector failed"):
            pipe.generate([(prompts[:2], [3, 3], broken), (prompts[2:], [3, 3], GreedyRecorder())])
        sel = GreedyRecorder()
        pipe.generate([(prompts[:2], [2, 2], sel)])                      # usable again afterwards
        assert sorted(sel.tokens) == [0, 1]
    finally:
        pipe.close()


def test_pipeline_needs_first_and_last_stage(tiny_checkpoints):
    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.float32)
    st = StageExecutor(loaded, Policy(), Stage(0, range(0, 1), True, False, 1.0), device=torch.device("cpu"),
                       dtype=torch.float32)
    try:
        with pytest.raises(ValueError, match="embedding to the one holding the head"):
            Pipeline([st])
    finally:
        st.close()


@pytest.mark.parametrize("kind", ["llama", "opt"])
def test_shared_prefix_crosses_stages(tiny_checkpoints, tmp_path, kind):
    """Prompts sharing a system-prompt-like prefix: the prefill's (prefix, rows) hidden pair crosses the stage
    boundary, and the tokens are those of one executor."""
    loaded = load_model(tiny_checkpoints[kind], dtype=torch.float32)
    policy = Policy(gpu_batch_size=3, num_gpu_batches=1, cache_gpu=0.0, cache_cpu=1.0)
    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(3, loaded.config.vocab_size, (12,), generator=g).tolist()
    prompts = sorted((prefix + torch.randint(3, loaded.config.vocab_size, (n,), generator=g).tolist()
                      for n in (2, 5, 3, 7, 4, 6)), key=len)
    blocks = micro_blocks(prompts, [5] * 6, policy.block_size)
    want = one_executor(loaded, policy, blocks, (), tmp_path / "one")
    assert pipeline_tokens(loaded, policy, blocks, (), tmp_path / "pipe", ["cpu", "cpu"]) == want
