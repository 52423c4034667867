"""`LLM(devices=...)` on two CPU "devices": data-parallel lanes and a two-stage pipeline give the same
completions, in the caller's order, as one device; device lists are validated."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, Policy, SamplingParams
from engine.parallel import Lanes, choose_parallel, resolve_devices
from engine.runtime.pipeline import Pipeline
from helpers.greedy_runs import id_prompts

POLICIES = {
    "resident": Policy(gpu_batch_size=2, num_gpu_batches=1),
    "offloaded": Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.0, cache_cpu=1.0,
                        cpu_attention=True),
}


@pytest.fixture(scope="module")
def folder(tiny_llama):
    return tiny_llama


def _texts(completions):
    return [(c.token_ids, c.finish_reason, c.text) for c in completions]


@pytest.fixture(scope="module")
def reference(folder):
    out = {}
    for name, policy in POLICIES.items():
        with LLM(folder, dtype="float32", device="cpu", policy=policy) as one:
            out[name] = _texts(one.generate(id_prompts(12, seed=4), SamplingParams(max_new_tokens=6)))
    return out


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("parallel", ["data", "pipeline"])
def test_two_cpu_devices_match_one(folder, reference, parallel, name):
    finished: dict[int, list[int]] = {}
    llm = LLM(folder, dtype="float32", devices=["cpu", "cpu"], parallel=parallel, policy=POLICIES[name])
    try:
        groups = list(llm.stream(id_prompts(12, seed=4), SamplingParams(max_new_tokens=6),
                                 on_finished=lambda i, c: finished.setdefault(i, c.token_ids)))
        got = dict(pair for g in groups for pair in g)
        assert sorted(got) == list(range(12)) and sum(len(g) for g in groups) == 12
        assert _texts(got[i] for i in range(12)) == reference[name]
        assert finished == {i: got[i].token_ids for i in range(12)}
        engine = llm._parallel
        assert isinstance(engine, Lanes if parallel == "data" else Pipeline)
        if parallel == "data":     # both lanes ran blocks
            assert all(ex.stats.get("steps", 0) > 0 for ex in engine.executors)
        else:
            assert [len(st.specs) for st in engine.stages] == [1 + 2, 2 + 1]   # embed + layer 0 | layer 1 + head
    finally:
        llm.close()


def test_generate_keeps_the_callers_order_across_lanes(folder, reference):
    with LLM(folder, dtype="float32", devices=["cpu", "cpu"], policy=POLICIES["resident"]) as llm:
        assert _texts(llm.generate(id_prompts(12, seed=4), SamplingParams(max_new_tokens=6))) == reference["resident"]
        assert isinstance(llm._parallel, Lanes)     # auto: the weights stay on the gpu tier -> data-parallel


def test_choose_parallel():
    assert choose_parallel("auto", Policy(), 1) == "single"
    assert choose_parallel("pipeline", Policy(), 1) == "single"
    assert choose_parallel("auto", Policy(), 2) == "data"
    assert choose_parallel("auto", Policy(w_gpu=0.5, w_cpu=0.5), 2) == "pipeline"
    assert choose_parallel("data", Policy(w_gpu=0.0, w_cpu=1.0), 4) == "data"
    with pytest.raises(ValueError, match="parallel=.*'tensor'"):
        choose_parallel("tensor", Policy(), 2)


def test_resolve_devices():
    cpu = torch.device("cpu")
    assert resolve_devices(None, cpu) == [cpu]
    assert resolve_devices(["cpu", "cpu"], cpu) == [cpu, cpu]
    if not torch.cuda.is_available():
        assert resolve_devices("auto", cpu) == [cpu]
        with pytest.raises(ValueError, match="0 names CUDA device 0, but 0 are visible"):
            resolve_devices([0, 1], cpu)
    for bad, message in [("all", "expected 'auto'"), ([], "empty"), ([True], "neither a CUDA index")]:
        with pytest.raises(ValueError, match=message):
            resolve_devices(bad, cpu)


def test_bad_parallel_raises_before_loading(tmp_path):
    with pytest.raises(ValueError, match="parallel="):
        LLM(tmp_path / "missing", devices=["cpu", "cpu"], parallel="model")
