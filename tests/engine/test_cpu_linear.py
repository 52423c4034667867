"""CPU weight packing (engine.models.cpu_linear): oneDNN-packed bfloat16 gives F.linear's bits, the int4 kernel
multiplies a QTensor's own codes, float32 stays dense, and an executor on the CPU holds the family's linear
weights packed with the same greedy tokens as unpacked."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.quant.config import int4_kernel_parts
from engine.models.cpu_linear import Int4Linear, int4_packable, linear, onednn_bf16, pack_weight
from engine.models.loader import load_model
from engine.policy.policy import Policy
from engine.quant.config import QuantConfig
from engine.quant.group import dequantize, quantize
from helpers.greedy_runs import make_prompts, run_policy

needs_onednn = pytest.mark.skipif(not onednn_bf16(), reason="this torch build runs no bfloat16 oneDNN matmul here")


@needs_onednn
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5)])
def test_onednn_packed_bf16_equals_f_linear(lead):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(*lead, 64, generator=gen).bfloat16()
    packed = pack_weight(w)
    assert packed.is_mkldnn and tuple(packed.shape) == (96, 64)
    assert torch.equal(linear(x, packed), F.linear(x, w))
    assert torch.equal(linear(x, packed, b), F.linear(x, w, b))


def test_float32_stays_dense():
    w = torch.randn(8, 4)
    assert pack_weight(w) is w


@pytest.mark.parametrize("group", [32, 64])
def test_int4_kernel_multiplies_the_qtensor_codes(group):
    gen = torch.Generator().manual_seed(1)
    w = (0.05 * torch.randn(48, 128, generator=gen)).bfloat16()
    q = quantize(w, QuantConfig(group_size=group))
    packed = pack_weight(q, int4_max_rows=4)
    assert isinstance(packed, Int4Linear) and packed.shape == (48, 128)
    # the operands are what the buffer plan counts for them (`int4_kernel_parts`), shape and dtype
    assert [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in (packed.packed, packed.scales_zeros)] == [
        (shape, dtype) for _, shape, dtype in int4_kernel_parts((48, 128), "bfloat16", q.config)]
    for lead in [(1, 1), (2, 2), (2, 3)]:                           # 1 and 4 rows: the int4 kernel; 6: dense
        x = torch.randn(*lead, 128, generator=gen).bfloat16()
        want = F.linear(x.float(), dequantize(q).float())                                 # [*lead, 48]
        got = linear(x, packed)
        assert got.dtype == torch.bfloat16 and got.shape == (*lead, 48)
        assert (got.float() - want).abs().max() <= 0.02 * want.abs().max()             # bf16 rounding


def test_int4_packable_refuses_what_the_kernel_cannot_take():
    w = torch.randn(16, 96).bfloat16()
    assert not int4_packable(quantize(w, QuantConfig(group_size=64)))                 # 96 is not whole groups
    assert not int4_packable(quantize(w, QuantConfig(group_size=32, rotate=True)))    # a rotated basis
    assert not int4_packable(quantize(w, QuantConfig(group_size=6)))                  # not a kernel group size
    q = quantize(w, QuantConfig(group_size=6))
    assert pack_weight(q) is q
    fp32 = quantize(w.float(), QuantConfig(group_size=32))                         # a float32 model dequantizes
    assert not int4_packable(fp32) and pack_weight(fp32) is fp32


@needs_onednn
def test_executor_packs_linear_weights_same_tokens(tiny_checkpoints):
    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.bfloat16)
    prompts = make_prompts(4, loaded.config.vocab_size, seed=3)
    policy = Policy(gpu_batch_size=4)
    packed_tokens, ex = run_policy(loaded, policy, prompts, [6] * 4, dtype=torch.bfloat16)
    assert ex.weights is None                                                          # closed
    loaded.family.LINEAR_WEIGHTS = frozenset()                                         # this instance: unpacked
    dense_tokens, _ = run_policy(loaded, policy, prompts, [6] * 4, dtype=torch.bfloat16)
    assert packed_tokens == dense_tokens


@needs_onednn
def test_packed_homes_replace_the_dense_ones(tiny_checkpoints):
    from engine.runtime.executor import Executor

    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.bfloat16)
    ex = Executor(loaded, Policy(gpu_batch_size=2), device=torch.device("cpu"), dtype=torch.bfloat16)
    try:
        attn = ex.weights.get(1, 0)
        assert attn["qkv_proj.weight"].is_mkldnn and attn["o_proj.weight"].is_mkldnn
        assert not attn["input_layernorm.weight"].is_mkldnn
        assert ex.weights.get(len(ex.specs) - 1, 0)["lm_head.weight"].is_mkldnn
        home = next(k for k in ex.arena.held if k.endswith("qkv_proj.weight"))
        assert home in ex.arena._elsewhere and home not in ex.arena._flat          # one copy: the reordered one
    finally:
        ex.close()


def test_compressed_executor_runs_int4_kernel(tiny_checkpoints):
    from engine.runtime.executor import Executor

    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.bfloat16)
    policy = Policy(gpu_batch_size=2, compress_weights=True)
    ex = Executor(loaded, policy, device=torch.device("cpu"), dtype=torch.bfloat16,
                  quant_config=QuantConfig(group_size=32))
    try:
        assert isinstance(ex.weights.get(1, 0)["qkv_proj.weight"], Int4Linear)
    finally:
        ex.close()
