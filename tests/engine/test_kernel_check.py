"""`engine.util.kernel_check.first_use_check`: the optional kernels' fallback rule."""
from __future__ import annotations

import warnings

import pytest

from engine.util.kernel_check import first_use_check


def test_passing_check_is_true_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert first_use_check("op", "cuda:0", lambda: True) is True


def test_missing_triton_is_a_silent_fallback():
    def check() -> bool:
        raise ModuleNotFoundError("No module named 'triton'")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert first_use_check("op", "cuda:0", check) is False


def test_failing_kernel_warns_and_falls_back():
    def check() -> bool:
        raise RuntimeError("the Triton op kernel differs from the torch ops")

    with pytest.warns(RuntimeWarning, match=r"quantize: the Triton kernel failed on cuda:1 .*differs.*using torch ops"):
        assert first_use_check("quantize", "cuda:1", check) is False
