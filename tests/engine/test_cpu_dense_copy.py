"""A CPU run's dense copy beside its 4-bit weights (`Policy.cpu_dense_copy`): past the int4 kernel's crossing it
gives the products of the dequantize path (`F.linear` over the dequantized matrix) bit for bit, up to it the
kernel's own; the buffer plan counts every copy (and drops the prefill's `wdq` buffer it replaces), the arena
holds them, and the greedy tokens equal the dequantize path's at the same crossing."""
from __future__ import annotations

import pytest
import torch

from engine.models.cpu_linear import Int4Linear, dense_copy, linear, onednn_bf16, pack_int4
from engine.models.loader import load_model
from engine.policy.memory import executor_memory
from engine.policy.policy import Policy
from engine.quant.config import QuantConfig
from engine.quant.group import quantize
from engine.runtime.executor import Executor
from helpers.greedy_runs import GreedyRecorder, make_prompts

pytestmark = pytest.mark.skipif(not onednn_bf16(), reason="this torch build runs no bfloat16 oneDNN matmul here")

W4 = Policy(gpu_batch_size=4, compress_weights=True)
DENSE = Policy(gpu_batch_size=4, compress_weights=True, cpu_dense_copy=True)
GROUPS = QuantConfig(group_size=32)


@pytest.mark.parametrize("rows", [1, 4, 5, 64, 80])
def test_dense_copy_gives_the_dequantize_paths_products(rows):
    gen = torch.Generator().manual_seed(2)
    q = quantize((0.05 * torch.randn(96, 128, generator=gen)).bfloat16(), GROUPS)
    bias = torch.randn(96, generator=gen).bfloat16()
    plain, dense = pack_int4(q, max_rows=4), pack_int4(q, max_rows=4, dense=dense_copy(q))
    assert dense.dense.is_mkldnn and tuple(dense.dense.shape) == (96, 128)
    x = torch.randn(rows, 128, generator=gen).bfloat16()                                      # [rows, 128]
    for b in (None, bias):
        assert torch.equal(linear(x, dense, b), linear(x, plain, b))                           # [rows, 96]


def _executor(loaded, policy: Policy, **rows) -> Executor:
    return Executor(loaded, policy, device=torch.device("cpu"), dtype=torch.bfloat16, quant_config=GROUPS, **rows)


def test_plan_counts_and_arena_holds_the_dense_copies(tiny_checkpoints):
    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.bfloat16)
    ex, plain = _executor(loaded, DENSE), _executor(loaded, W4)
    try:
        planned, before = ex.plan.buffers(), plain.plan.buffers()
        added, dropped = set(planned) - set(before), set(before) - set(planned)
        weights = [(spec.name, n, v) for spec, homes in zip(ex.specs, ex.weights.homes) for n, v in homes.items()
                   if isinstance(v.value, Int4Linear)]
        assert weights and added == {f"packed.{layer}.{n}.dense" for layer, n, _ in weights}
        assert dropped and all(k.startswith("wdq.") for k in dropped)          # no per-call dequantized copy
        for layer, n, handle in weights:
            key = f"packed.{layer}.{n}.dense"
            assert handle.value.dense.is_mkldnn and planned[key].nbytes == 2 * handle.value.shape.numel()
            assert key in ex.arena._elsewhere and key not in ex.arena._flat    # held once, in oneDNN's layout
        extra = sum(planned[k].nbytes for k in added) - sum(before[k].nbytes for k in dropped)
        memory = [executor_memory(loaded.config, e.layout, p, 8, 4, 2, "cpu") for e, p in ((ex, DENSE), (plain, W4))]
        assert memory[0]["gpu"] - memory[1]["gpu"] == extra > 0                 # the memory model's own count
    finally:
        ex.close()
        plain.close()


def test_greedy_tokens_equal_the_dequantize_paths(tiny_checkpoints):
    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.bfloat16)
    prompts = make_prompts(4, loaded.config.vocab_size, seed=5)
    tokens = []
    for policy in (W4, DENSE):
        ex = _executor(loaded, policy, int4_max_rows=2, int4_dense_max_rows=2)   # one crossing for both
        try:
            sel = GreedyRecorder()
            ex.generate_block(prompts, [6] * 4, sel)
            tokens.append(sel.tokens)
        finally:
            ex.close()
    assert tokens[0] == tokens[1]


def test_another_device_refuses_the_dense_copy(tiny_checkpoints):
    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cpu_dense_copy"):
        Executor(loaded, DENSE, device=torch.device("cuda"), dtype=torch.bfloat16)
