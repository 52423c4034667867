"""Unit tests of the pure sampling functions and the block ordering."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.decoding.blocks import plan_blocks, scatter
from engine.decoding.sampling import chosen_logprobs, greedy, sample, sequence_key, sequence_keys, uniforms


def test_greedy_picks_first_max():
    logits = torch.tensor([[0.0, 3.0, 3.0, -1.0], [5.0, 1.0, 0.0, 0.0]])
    assert greedy(logits).tolist() == [1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_on_ties_nan_and_masked_rows(dtype):
    """Rows of many tied maxima (a few values over the vocabulary), a NaN, and every token masked: the indices
    torch.argmax gives."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (64, 49152), generator=g).to(dtype)      # [64, v]: ties everywhere
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))


def test_sequence_keys_depend_on_seed_prompt_and_occurrence():
    a, b = [1, 2, 3], [1, 2, 4]
    keys = sequence_keys(7, [a, b, a, a])
    assert keys[0] != keys[2] != keys[3] and keys[0] != keys[3]      # occurrences 0, 1, 2 of `a`
    assert keys[0] == sequence_key(7, a, 0) and keys[2] == sequence_key(7, a, 1)
    assert sequence_key(7, a) != sequence_key(8, a)
    assert sequence_key(7, a) != sequence_key(7, b)
    assert sequence_keys(7, [b, a]) == [keys[1], keys[0]]             # order of other prompts is irrelevant


def test_uniforms_are_deterministic_in_range_and_spread():
    keys = [sequence_key(0, [i]) for i in range(2000)]
    u = uniforms(keys, [3] * len(keys))
    assert np.array_equal(u, uniforms(keys, [3] * len(keys)))
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.03
    assert not np.array_equal(u, uniforms(keys, [4] * len(keys)))
    # one row's number does not depend on the other rows of the batch
    assert uniforms(keys[5:6], [3])[0] == u[5]


def test_sample_matches_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7]])).repeat(4000, 1)
    u = torch.from_numpy(uniforms([sequence_key(1, [i]) for i in range(4000)], [0] * 4000))
    counts = torch.bincount(sample(logits, u, temperature=1.0), minlength=3).float() / 4000
    assert torch.allclose(counts, torch.tensor([0.1, 0.2, 0.7]), atol=0.03)


def test_sample_top_k_and_top_p_restrict_support():
    logits = torch.log(torch.tensor([[0.05, 0.15, 0.3, 0.5]])).repeat(500, 1)
    u = torch.from_numpy(uniforms([sequence_key(2, [i]) for i in range(500)], [0] * 500))
    assert set(sample(logits, u, temperature=1.0, top_k=2).tolist()) == {2, 3}
    assert set(sample(logits, u, temperature=1.0, top_p=0.6).tolist()) == {2, 3}
    assert set(sample(logits, u, temperature=1.0, top_p=0.45).tolist()) == {3}
    assert set(sample(logits, u, temperature=1.0, top_p=0.85).tolist()) == {1, 2, 3}


def test_sample_never_draws_masked_tokens_and_is_row_independent():
    torch.manual_seed(0)
    logits = torch.randn(64, 50)
    logits[:, ::2] = float("-inf")
    u = torch.from_numpy(uniforms([sequence_key(3, [i]) for i in range(64)], [5] * 64))
    drawn = sample(logits, u, temperature=0.8, top_p=0.9)
    assert (drawn % 2 == 1).all()
    alone = torch.stack([sample(logits[i:i + 1], u[i:i + 1], temperature=0.8, top_p=0.9)[0] for i in range(64)])
    assert torch.equal(drawn, alone)


def test_top_p_flat_rows_fall_back_to_a_full_sort():
    torch.manual_seed(2)
    peaked = torch.randn(3, 2000) * 8          # nucleus inside the top-256 candidates
    flat = torch.randn(3, 2000) * 0.01         # nucleus of ~1800 tokens: needs the full sort
    logits = torch.cat([peaked, flat])
    u = torch.from_numpy(uniforms([sequence_key(4, [i]) for i in range(6)], [0] * 6))
    drawn = sample(logits, u, temperature=1.0, top_p=0.9)
    alone = torch.stack([sample(logits[i:i + 1], u[i:i + 1], temperature=1.0, top_p=0.9)[0] for i in range(6)])
    assert torch.equal(drawn, alone)
    probs = torch.softmax(logits, -1)
    for i in range(6):  # every draw lies in its row's nucleus
        sorted_probs, order = probs[i].sort(descending=True)
        nucleus = set(order[(sorted_probs.cumsum(0) - sorted_probs) < 0.9].tolist())
        assert drawn[i].item() in nucleus
    assert len(set(drawn[3:].tolist())) == 3


def test_low_temperature_sampling_is_greedy():
    torch.manual_seed(1)
    logits = torch.randn(32, 100)
    u = torch.rand(32, dtype=torch.float64)
    assert torch.equal(sample(logits, u, temperature=1e-4), greedy(logits))


def test_sample_rejects_zero_temperature():
    with pytest.raises(ValueError, match="temperature"):
        sample(torch.zeros(1, 3), torch.zeros(1), temperature=0.0)


def test_chosen_logprobs():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    lp = chosen_logprobs(logits, torch.tensor([2, 1]))
    expected = torch.log_softmax(logits, -1)[[0, 1], [2, 1]]
    assert torch.allclose(lp, expected)


def test_plan_blocks_sorts_and_cuts():
    lengths = [5, 1, 9, 1, 3, 7, 2]
    blocks = plan_blocks(lengths, 3)
    assert blocks == [[1, 3, 6], [4, 0, 5], [2]]
    assert sorted(i for b in blocks for i in b) == list(range(len(lengths)))
    assert plan_blocks([], 4) == []
    with pytest.raises(ValueError, match="block_size"):
        plan_blocks([1], 0)


def test_scatter_restores_input_order():
    out: list = [None] * 4
    scatter(["c", "a"], [2, 0], out)
    scatter(["d", "b"], [3, 1], out)
    assert out == ["a", "b", "c", "d"]
