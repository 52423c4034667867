"""Pipeline and data parallelism on CUDA (tiny checkpoints, fp32): stages on one GPU (the same code a
multi-GPU machine runs) and, where two GPUs are visible, on two; skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, Policy, SamplingParams
from engine.models.loader import load_model
from helpers.greedy_runs import id_prompts, make_prompts
from helpers.skips import requires_cuda
from helpers.stage_pipeline import POLICIES, micro_blocks, one_executor, pipeline_tokens

pytestmark = requires_cuda
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

DEVICES = {"one_gpu": ["cuda:0", "cuda:0"], "two_gpus": ["cuda:0", "cuda:1"]}


@pytest.mark.parametrize("where", [pytest.param("one_gpu"), pytest.param("two_gpus", marks=two_gpus)])
@pytest.mark.parametrize("name", list(POLICIES) + ["compressed"])
@pytest.mark.parametrize("kind", ["llama", "opt", "mixtral"])
def test_cuda_stages_match_one_executor(tiny_checkpoints, tmp_path, kind, name, where):
    loaded = load_model(tiny_checkpoints[kind], dtype=torch.float32)
    extra = dict(w_gpu=0.0, w_cpu=1.0, compress_weights=True, compress_cache=True) if name == "compressed" \
        else POLICIES[name]
    policy = Policy(**{"gpu_batch_size": 2, "num_gpu_batches": 2, **extra})
    prompts = make_prompts(9, loaded.config.vocab_size, seed=5)
    blocks = micro_blocks(prompts, [6, 9, 3, 9, 7, 9, 5, 9, 8], policy.block_size)
    want = one_executor(loaded, policy, blocks, (), tmp_path / "one", device="cuda:0")
    assert pipeline_tokens(loaded, policy, blocks, (), tmp_path / "pipe", DEVICES[where]) == want


@two_gpus
@pytest.mark.parametrize("parallel", ["data", "pipeline"])
def test_llm_on_two_gpus_matches_one(tiny_checkpoints, parallel):
    policy = Policy(gpu_batch_size=2, num_gpu_batches=1, w_gpu=0.0, w_cpu=1.0)
    params = SamplingParams(max_new_tokens=6)
    with LLM(tiny_checkpoints["llama"], dtype="float32", device="cuda:0", policy=policy) as one:
        want = [c.token_ids for c in one.generate(id_prompts(12, seed=4), params)]
    with LLM(tiny_checkpoints["llama"], dtype="float32", devices=[0, 1], parallel=parallel, policy=policy) as two:
        assert [c.token_ids for c in two.generate(id_prompts(12, seed=4), params)] == want
        assert {str(d) for d in two.devices} == {"cuda:0", "cuda:1"}
