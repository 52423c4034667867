"""The CPU greedy-choice C kernel (engine.decoding.native_argmax) against torch's reductions, its routing from
`sampling.greedy`, and its fallback when it cannot be built."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from engine.decoding import native_argmax as nx
from engine.decoding.sampling import greedy
from helpers.native_kernels import failing_build

needs_kernel = pytest.mark.skipif(nx._kernel() is None, reason="no AVX512-BF16 CPU or C compiler: the kernel is not built")


def _logits(rows: int, width: int, seed: int = 0, levels: int = 0) -> torch.Tensor:
    """[rows, width] bfloat16 rows at a stride of width + 5; `levels` > 0: values in {0..levels-1}, ties galore."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, width + 5), generator=gen).float() if levels else \
        4 * torch.randn(rows, width + 5, generator=gen)
    return x.to(torch.bfloat16)[:, :width]


@needs_kernel
@pytest.mark.parametrize("rows,width,levels", [(1, 1, 0), (3, 15, 0), (2, 17, 2), (64, 49152, 0), (64, 49152, 3),
                                               (5, 1003, 1)])
def test_the_first_maximum_as_torch_gives_it_over_float32(rows, width, levels):
    logits = _logits(rows, width, levels=levels)
    got = nx.native_argmax(logits)
    assert got is not None and got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, logits.float().argmax(dim=-1))
    assert torch.equal(got, logits.max(dim=-1).indices)


@needs_kernel
def test_nan_infinities_and_masked_rows():
    """A row's first NaN wins over +inf and a later NaN; tied +inf give the first; an all -inf row (a grammar
    masked every token) gives 0, as torch does."""
    logits = _logits(4, 100)
    logits[0, [70, 30]] = float("nan")
    logits[0, 10] = float("inf")
    logits[1, [80, 40]] = float("inf")
    logits[2] = float("-inf")
    logits[3, 99] = 100.0
    got = nx.native_argmax(logits)
    assert got.tolist() == [30, 40, 0, 99]
    assert torch.equal(got, logits.float().max(dim=-1).indices)


def test_what_it_does_not_take_returns_none():
    logits = _logits(2, 40)
    assert nx.native_argmax(logits.float()) is None                              # float32
    assert nx.native_argmax(logits[0]) is None                                   # 1-D
    assert nx.native_argmax(logits[:, ::2]) is None                              # strided last dim
    assert nx.native_argmax(logits[:, :0]) is None                               # empty rows


@needs_kernel
def test_greedy_takes_the_kernel_for_bfloat16(monkeypatch):
    logits = _logits(3, 500, levels=4)
    calls = []
    monkeypatch.setattr(nx, "_run", lambda kernel, x: calls.append(x.shape) or torch.zeros(3, dtype=torch.int64))
    assert greedy(logits).tolist() == [0, 0, 0] and calls == [(3, 500)]
    assert torch.equal(greedy(logits.float()), logits.float().argmax(dim=-1)) and len(calls) == 1


def test_a_kernel_that_fails_to_build_warns_once_and_torch_runs(monkeypatch):
    logits = _logits(3, 300, levels=5)
    with failing_build(monkeypatch, nx._kernel):
        with pytest.warns(RuntimeWarning, match="native argmax: the C kernel failed.*using torch ops"):
            assert nx._kernel() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")                                     # warned once, not per call
            assert torch.equal(greedy(logits), logits.argmax(dim=-1))


def test_the_source_ships_beside_its_module():
    assert nx.SOURCE.is_file() and nx.SOURCE.parent == Path(nx.__file__).parent
    assert "llmops_argmax_bf16" in nx.SOURCE.read_text()
