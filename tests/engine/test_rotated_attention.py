"""Decode attention over a rotated 4-bit KV cache in its rotated basis (never un-rotating a cache row) equals
the dequantize-then-attend path: the basis helpers, the attention core (MHA, GQA, padded head_dim, masks,
soft-capping, row chunks) and every KV-home path of the executor (fp32, CPU; the cores also on CUDA)."""
from __future__ import annotations

import pytest
import torch

from engine.models import attention, quant_decode
from engine.models.attention import chunked_decode_attention, cpu_decode_attention, decode_attention
from engine.models.loader import load_model
from engine.policy.policy import Policy
from engine.quant.config import CACHE_QUANT, QuantConfig
from engine.quant.group import dequantize, quantize, rotate_last, unrotate_last
from engine.runtime import kv_cache
from helpers.greedy_runs import make_prompts, run_logits as run

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
# (batch, query heads, kv heads, positions, head_dim, group size)
SHAPES = {"mha": (3, 4, 4, 17, 64, 64), "gqa": (5, 8, 2, 33, 128, 64), "gqa_g32": (4, 6, 2, 9, 128, 32),
          "padded_hd96": (2, 4, 2, 12, 96, 64), "hd16_in_g64": (3, 4, 1, 7, 16, 64)}


def _case(shape: tuple[int, ...], device: str, seed: int = 0):
    b, nh, nkv, t, hd, gs = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nh, 1, hd, generator=g)                                 # [b, nh, 1, hd]
    k = torch.randn(b, nkv, t, hd, generator=g) * 2 + 0.5                      # [b, nkv, t, hd]
    v = torch.randn(b, nkv, t, hd, generator=g)
    valid = torch.rand(b, t, generator=g) > 0.3                                # [b, t] with masked keys
    valid[:, -1] = True
    cfg = QuantConfig(group_size=gs, rotate=True)
    qk, qv = quantize(k.to(device), cfg), quantize(v.to(device), cfg)
    return q.to(device), qk, qv, valid.to(device), cfg


def _reference(q, qk, qv, valid, scale, softcap=None):
    """The plain path: dequantize (un-rotating every row), then attend."""
    return decode_attention(q, dequantize(qk), dequantize(qv), valid, scale, softcap)


@pytest.mark.parametrize("d,gs", [(64, 64), (128, 64), (96, 64), (16, 64), (40, 32)])
def test_rotate_last_and_unrotate_last_are_inverse_and_keep_dot_products(d, gs):
    cfg = QuantConfig(group_size=gs, rotate=True)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(3, 5, d, generator=g), torch.randn(3, 5, d, generator=g)
    rx, ry = rotate_last(x, cfg), rotate_last(y, cfg)
    assert rx.shape == (3, 5, -(-d // gs) * gs)
    torch.testing.assert_close(unrotate_last(rx, cfg, d), x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close((rx * ry).sum(-1), (x * y).sum(-1), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rx[..., :d], x)                                  # it really rotated
    plain = QuantConfig(group_size=gs)
    assert torch.equal(unrotate_last(rotate_last(x, plain), plain, d), x)      # unrotated: padding only


@pytest.mark.parametrize("d", [64, 96, 16])
def test_dequantize_in_the_stored_basis(d):
    cfg = CACHE_QUANT
    x = torch.randn(2, 3, 6, d, generator=torch.Generator().manual_seed(2))
    q = quantize(x, cfg)
    stored = dequantize(q, unrotate=False)                                     # [2, 3, 6, G]
    assert stored.shape == (2, 3, 6, -(-d // 64) * 64)
    torch.testing.assert_close(unrotate_last(stored, cfg, d), dequantize(q), rtol=1e-5, atol=1e-6)
    out = torch.empty(2, 3, 10, stored.shape[-1])
    dequantize(q, out=out[:, :, 2:8], unrotate=False)                          # straight into a slice
    assert torch.equal(out[:, :, 2:8], stored)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap", [None, 0.7])
@pytest.mark.parametrize("name", list(SHAPES))
def test_rotated_attention_equals_dequantize_then_attend(name, softcap, device):
    q, qk, qv, valid, cfg = _case(SHAPES[name], device)
    scale = q.shape[-1] ** -0.5
    want = _reference(q, qk, qv, valid, scale, softcap)

    def stored_kv(r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:  # [r1-r0, nkv, t, G] rotated basis
        return dequantize(qk[r0:r1], unrotate=False), dequantize(qv[r0:r1], unrotate=False)

    got = chunked_decode_attention(q, stored_kv, valid, scale, max(1, q.shape[0] // 2), softcap, cfg)  # 2+ chunks
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_bytes", [1, 3000, 1 << 30], ids=["row", "rows", "whole"])
@pytest.mark.parametrize("name", ["gqa", "padded_hd96"])
def test_chunked_host_attention_equals_dequantize_then_attend(name, chunk_bytes):
    q, qk, qv, valid, cfg = _case(SHAPES[name], "cpu", seed=3)
    scale = q.shape[-1] ** -0.5
    got = cpu_decode_attention(q, qk, qv, valid, scale, chunk_bytes=chunk_bytes)
    torch.testing.assert_close(got, _reference(q, qk, qv, valid, scale), rtol=1e-5, atol=1e-5)


def _spy_unrotate(monkeypatch) -> list[int]:
    """Record the rows of every attention output un-rotated (once per rotated-basis attention call: the chunked
    path's, or on CUDA the fused kernel's, `engine.models.quant_decode`)."""
    calls, original = [], attention.unrotate_last

    def spy(y, config, d):
        calls.append(y.shape[0])
        return original(y, config, d)
    monkeypatch.setattr(attention, "unrotate_last", spy)
    monkeypatch.setattr(quant_decode, "unrotate_last", spy)
    return calls


def test_unrotated_and_dense_caches_keep_their_path(monkeypatch):
    """Only a rotated pair is attended in the rotated basis (its output un-rotated once for the whole batch,
    over many chunks); unrotated 4-bit and dense caches are attended as stored."""
    calls = _spy_unrotate(monkeypatch)
    q, qk, qv, valid, _ = _case(SHAPES["gqa"], "cpu")
    k, v = dequantize(qk), dequantize(qv)
    plain = QuantConfig(group_size=64)
    assert cpu_decode_attention(q, k, v, valid, 0.1, chunk_bytes=1).shape == q.shape
    assert cpu_decode_attention(q, quantize(k, plain), quantize(v, plain), valid, 0.1).shape == q.shape
    assert calls == []
    cpu_decode_attention(q, qk, qv, valid, 0.1, chunk_bytes=1)
    assert calls == [q.shape[0]]


# 4-bit cache on each home: the gpu tier (in place), the cpu tier loaded into a device buffer (the new token
# dense), the cpu and disk tiers with host attention (inline and on the CGOPipe thread), split across tiers.
KV_POLICIES = {
    "cache_gpu": dict(compress_cache=True),
    "cache_cpu_loaded": dict(cache_gpu=0.0, cache_cpu=1.0, compress_cache=True),
    "cache_cpu_attn": dict(cache_gpu=0.0, cache_cpu=1.0, compress_cache=True, cpu_attention=True),
    "cache_split_disk_attn": dict(cache_gpu=0.5, cache_cpu=0.0, compress_cache=True, cpu_attention=True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(KV_POLICIES))
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_kv_home_paths_equal_dequantize_then_attend(tiny_checkpoints, kind, name, device, monkeypatch, tmp_path):
    """Whole decode runs (fp32, decode in chunks of one row): the rotated paths give the plain path's greedy
    tokens and logits within fp32 tolerance; the plain path is the same code with no rotation detected."""
    dev = torch.device(device)
    loaded = load_model(tiny_checkpoints[kind], dtype=torch.float32)
    prompts = make_prompts(5, loaded.config.vocab_size, seed=21, lo=3, hi=12)
    max_new = [5, 3, 6, 4, 6]
    policy = Policy(gpu_batch_size=5, num_gpu_batches=1, **KV_POLICIES[name])
    calls = _spy_unrotate(monkeypatch)
    got = run(loaded, policy, prompts, max_new, tmp_path / "new", device=dev, decode_chunk_bytes=1)
    assert calls                                                               # attended in the rotated basis
    monkeypatch.setattr(attention, "stored_rotation", lambda k, v: None)
    monkeypatch.setattr(kv_cache, "stored_rotation", lambda k, v: None)
    calls.clear()
    ref = run(loaded, policy, prompts, max_new, tmp_path / "plain", device=dev, decode_chunk_bytes=1)
    assert calls == []                                                         # the plain path un-rotates rows
    assert got.tokens == ref.tokens
    for r in ref.logits:
        torch.testing.assert_close(torch.stack(got.logits[r]), torch.stack(ref.logits[r]), rtol=1e-5, atol=1e-5)
