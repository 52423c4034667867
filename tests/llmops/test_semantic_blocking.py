"""Blocking and connected components: pure functions, table-driven (no model)."""
from __future__ import annotations

import itertools
import random

import pytest

from llmops.semantic.blocking import (Blocking, candidate_pairs, cross_candidate_pairs, jaccard, key_pairs, normalize,
                                      pair_recall, qgrams, similar_pairs)
from llmops.semantic.components import components, pair_scores, true_pairs


@pytest.mark.parametrize("text, expected", [
    ("O'Brien, Noah", "o brien noah"), ("  SONY  PlayStation_5 ", "sony playstation 5"), ("", ""),
])
def test_normalize(text, expected):
    assert normalize(text) == expected


def test_qgrams_ignore_word_order_and_case():
    assert qgrams("O'Brien, Noah") == qgrams("noah o brien")
    assert " no" in qgrams("Noah") and "ah " in qgrams("Noah")
    assert jaccard(qgrams("Isla Johnson"), qgrams("isla johnson")) == 1.0
    assert jaccard(frozenset(), frozenset()) == 0.0


def test_key_pairs_normalize_and_skip_nulls():
    assert key_pairs(["A 1", None, "a-1", "b", None, "a1", ""]) == {(0, 2)}


def _brute(texts, threshold, q=3):
    return {(i, j) for i, j in itertools.combinations(range(len(texts)), 2)
            if jaccard(qgrams(texts[i], q), qgrams(texts[j], q)) >= threshold}


def test_similar_pairs_equal_brute_force_without_caps():
    rng = random.Random(0)
    words = ["noah", "brien", "isla", "johnson", "smith", "olivia", "leeds", "boston"]
    texts = [" ".join(rng.sample(words, 3)) for _ in range(60)]
    found = similar_pairs(texts, threshold=0.3, top_k=10_000, max_posting=10_000)
    assert set(found) == _brute(texts, 0.3)
    assert all(i < j for i, j in found)


def test_top_k_and_max_posting_cut_pairs():
    texts = ["apple iphone 14"] * 10
    assert len(similar_pairs(texts, threshold=0.1, top_k=10_000)) == 45
    assert len(similar_pairs(texts, threshold=0.1, top_k=2)) < 45
    assert similar_pairs(texts, threshold=0.1, max_posting=5) == {}   # every q-gram is in 10 records


def test_candidate_pairs_union_keys_and_similarity():
    texts = ["Noah O'Brien", "O'Brien, Noah", "Isla Johnson", "Totally Other"]
    phones = ["123", None, "999", "123"]
    pairs = candidate_pairs(texts, [phones], Blocking(keys=("phone",), threshold=0.5))
    assert set(pairs) == {(0, 1), (0, 3)} and pairs[(0, 3)] == 1.0
    only_keys = candidate_pairs(texts, [phones], Blocking(keys=("phone",), threshold=None))
    assert set(only_keys) == {(0, 3)}


def test_cross_candidate_pairs():
    left, right = ["Sony WH-1000XM5 Black", "Apple iPhone 14"], ["iPhone 14 Apple", "WH-1000XM5 black Sony", "Bose"]
    pairs = cross_candidate_pairs(left, right, [(["x", "k"], ["k", "y", "x"])], Blocking(keys=("sku",), threshold=0.6))
    assert set(pairs) == {(0, 1), (1, 0), (0, 2)}   # (0, 1) and (1, 0) similar; (0, 2) and (1, 0) by key


def test_pair_recall():
    assert pair_recall({(1, 0), (2, 3)}, {(0, 1), (3, 4)}) == 0.5
    assert pair_recall(set(), set()) == 1.0


@pytest.mark.parametrize("kwargs", [dict(q=0), dict(threshold=1.5), dict(top_k=0), dict(threshold=None)])
def test_blocking_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError, match="blocking"):
        Blocking(**kwargs)


@pytest.mark.parametrize("n, pairs, expected", [
    (5, [], [0, 1, 2, 3, 4]),
    (5, [(3, 4), (1, 3)], [0, 1, 2, 1, 1]),
    (6, [(5, 4), (4, 3), (0, 5), (1, 2)], [0, 1, 1, 0, 0, 0]),
    (3, [(2, 2), (1, 2), (2, 1)], [0, 1, 1]),
])
def test_components_label_with_smallest_index(n, pairs, expected):
    assert components(n, pairs) == expected


def test_components_rejects_out_of_range():
    with pytest.raises(IndexError, match="outside"):
        components(2, [(0, 2)])


def test_pair_scores():
    assert true_pairs(["a", "a", "b", None, "b"]) == {(0, 1), (2, 4)}
    s = pair_scores([0, 0, 0, 3], ["x", "x", "y", "y"])
    assert s["precision"] == pytest.approx(1 / 3) and s["recall"] == 0.5 and s["true_pairs"] == 2
