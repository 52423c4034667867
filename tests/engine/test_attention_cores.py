"""The attention cores' building blocks against their plain definitions: grouped-query SDPA folded into the
query length (the CUDA path, `_folded_sdpa`) equals SDPA's own GQA, and `dense_keys` (a shared prefix, a
cache's positions and a new one, dense or 4-bit rotated) equals the concatenation it replaces."""
import pytest
import torch
import torch.nn.functional as F

from engine.models.attention import _folded_sdpa, causal_mask, cpu_decode_attention, decode_attention, dense_keys
from engine.quant.config import CACHE_QUANT
from engine.quant.group import dequantize, quantize, rotate_last


@pytest.mark.parametrize("b, nh, nkv, s, t", [(3, 8, 2, 5, 9), (1, 4, 4, 7, 7), (2, 6, 3, 1, 4)])
def test_folded_gqa_equals_sdpa_gqa(b, nh, nkv, s, t):
    g = torch.Generator().manual_seed(b * 100 + s)
    q = torch.randn(b, nh, s, 16, generator=g)                                     # [b, nh, s, hd]
    k, v = (torch.randn(b, nkv, t, 16, generator=g) for _ in range(2))             # [b, nkv, t, hd]
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[0, :2] = False                                                           # row 0 left-padded
    mask = causal_mask(valid, s)                                                   # [b, 1, s, t]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=nh != nkv)
    got = _folded_sdpa(q, k, v, mask, 0.25)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert got.transpose(1, 2).is_contiguous()                    # the attention output's reshape is a view


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "rotated-4bit"])
@pytest.mark.parametrize("with_new", [False, True])
def test_dense_keys_is_prefix_then_positions_then_new(quantized, with_new):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 2, 10, 128, generator=g)                                    # [c, h, S, hd]
    prefix = torch.randn(1, 2, 4, 128, generator=g)                                # [1, h, L, hd]
    new = torch.randn(3, 2, 1, 128, generator=g) if with_new else None             # [c, h, 1, hd]
    t = 6
    if quantized:
        stored = quantize(x, CACHE_QUANT)
        own = dequantize(stored[:, :, :t], unrotate=False)                         # [c, h, t, G] stored basis
        pre, rot = rotate_last(prefix, CACHE_QUANT), CACHE_QUANT
        tail = rotate_last(new, CACHE_QUANT) if with_new else None
    else:
        stored, own, pre, rot, tail = x, x[:, :, :t], prefix, None, new
    parts = [pre.expand(3, -1, -1, -1), own] + ([tail] if with_new else [])
    want = torch.cat(parts, dim=2)
    got = dense_keys(stored, t, rot, pre, new)
    assert got.shape == want.shape == (3, 2, 4 + t + with_new, 128)
    assert torch.equal(got, want)
    plain = dense_keys(stored, t, rot)                                              # no prefix, no new: as stored
    assert torch.equal(plain, own)


def test_reserved_rope_table_is_the_same_table_without_reading_positions():
    """A reservation (the executor's cache length) grows the table once; lookups below it give the values
    an unreserved lookup gives, and a position past it is the caller's error (out of the table)."""
    from engine.models.layers import RopeTable, reserve_positions, rope_cos_sin

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    free, reserved = RopeTable(inv_freq), RopeTable(inv_freq)

    class Family:                                   # a family holds its tables as instance attributes
        def __init__(self) -> None:
            self.rope = reserved

    reserve_positions(Family(), 300, torch.device("cpu"), torch.float32)
    positions = torch.tensor([[0, 5, 299], [7, 8, 9]])
    for got, want, direct in zip(reserved.lookup(positions, torch.float32), free.lookup(positions, torch.float32),
                                 rope_cos_sin(inv_freq, positions, torch.float32)):
        assert torch.equal(got, want) and torch.equal(got, direct)
    table = reserved._tables[(torch.device("cpu"), torch.float32)][0]
    assert table.shape[0] >= 300
    with pytest.raises(IndexError):
        reserved.lookup(torch.tensor([[table.shape[0]]]), torch.float32)


def test_dense_keys_takes_a_quantized_new_position_as_the_cache_holds_it():
    """A 4-bit cache's new decode position given quantized (as the home will store it) lands dequantized in
    the stored basis: the same values the home yields once that position is written into it."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 2, 6, 128, generator=g)                                     # [c, h, S, hd]
    new = torch.randn(2, 2, 1, 128, generator=g)                                   # [c, h, 1, hd]
    home = quantize(x, CACHE_QUANT)
    home[:, :, 4:5].copy_(quantize(new, CACHE_QUANT))                              # position 4 written
    got = dense_keys(home, 4, CACHE_QUANT, None, quantize(new, CACHE_QUANT))
    assert torch.equal(got, dense_keys(home, 5, CACHE_QUANT))


def test_an_executor_block_reads_no_position_on_the_host(tiny_checkpoints, monkeypatch):
    """The executor reserves its cache length before a block, so no RoPE lookup of the block reads
    positions.max() (on CUDA a host-device sync per attention layer, chunk and step): the tables grow only
    in `reserve`, and the tokens are those of a run that grows them on demand."""
    from engine.models import layers
    from engine.models.loader import load_model
    from engine.policy.policy import Policy
    from helpers.greedy_runs import make_prompts, run_policy

    loaded = load_model(tiny_checkpoints["llama"], dtype=torch.float32)
    prompts = make_prompts(6, loaded.config.vocab_size, seed=5)
    grown_on_demand: list[int] = []
    real_lookup = layers.RopeTable.lookup

    def lookup(self, positions, dtype):
        if (positions.device, dtype) not in self._reserved:
            grown_on_demand.append(positions.shape[1])
        return real_lookup(self, positions, dtype)

    monkeypatch.setattr(layers.RopeTable, "lookup", lookup)
    tokens, _ = run_policy(loaded, Policy(gpu_batch_size=3, num_gpu_batches=2), prompts, [4] * 6)
    assert grown_on_demand == []
    monkeypatch.setattr("engine.runtime.executor.reserve_positions", lambda *a: None)
    fresh = load_model(tiny_checkpoints["llama"], dtype=torch.float32)       # its own, unreserved tables
    unreserved, _ = run_policy(fresh, Policy(gpu_batch_size=3, num_gpu_batches=2), prompts, [4] * 6)
    assert grown_on_demand and unreserved == tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_attention_after_a_shared_prefix_equals_attention_over_the_joined_keys(dtype):
    """The prefix attended as one query sequence and the rows' own keys in place, merged by log-sum-exp:
    the attention over prefix + own keys of each row, with masked own positions, on a strided cache view."""
    gen = torch.Generator().manual_seed(3)
    b, nh, nkv, hd, L, t = 5, 8, 2, 16, 7, 6
    q = torch.randn(b, nh, 1, hd, generator=gen).to(dtype)
    home = torch.randn(b, nkv, t + 4, hd, generator=gen).to(dtype)           # a home longer than t positions
    k, v = home[:, :, :t], home.flip(0)[:, :, :t]                              # views, not contiguous
    pk, pv = (torch.randn(1, nkv, L, hd, generator=gen).to(dtype) for _ in range(2))
    valid = torch.ones(b, L + t, dtype=torch.bool)
    valid[1, L:L + 3] = False                                                  # a row's left padding
    got = cpu_decode_attention(q, k, v, valid, 0.25, prefix=(pk, pv))          # [b, nh, 1, hd]
    joined_k = torch.cat((pk.expand(b, -1, -1, -1), k), dim=2)                 # [b, nkv, L+t, hd]
    joined_v = torch.cat((pv.expand(b, -1, -1, -1), v), dim=2)
    want = decode_attention(q.float(), joined_k.float(), joined_v.float(), valid, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
