"""Q4_0, Q4_1, Q5_0 and Q8_0 blocks dequantized by torch ops give `gguf.quants.dequantize`'s bits."""
from __future__ import annotations

import numpy as np
import pytest

from engine.models.gguf_blocks import BLOCKS, dequantize_blocks


@pytest.mark.parametrize("ggml_type", sorted(BLOCKS))
def test_blocks_equal_gguf_numpy(ggml_type):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    size, head = BLOCKS[ggml_type]
    rng = np.random.default_rng(ggml_type)
    raw = rng.integers(0, 256, size=(64, size), dtype=np.uint8)
    scales = rng.normal(0, 0.01, size=(64, head // 2)).astype(np.float16)    # finite d (and m)
    raw[:, :head] = scales.view(np.uint8).reshape(64, head)
    want = dequantize(raw.reshape(-1), GGMLQuantizationType(ggml_type)).reshape(-1)
    got = dequantize_blocks(raw.reshape(-1), ggml_type).numpy()
    assert got.dtype == np.float32 and got.shape == (64 * 32,)
    assert np.array_equal(got, want.astype(np.float32))
