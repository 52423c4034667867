"""llama.cpp's Q4_0, Q4_1, Q5_0 and Q8_0 blocks dequantized by torch ops, with the bits of `gguf.quants`.

These are the blocks of the embedded models (SmolLM2's Q4_1 projections and Q8_0 embedding; the Q5_0 tensors of
Qwen2.5-0.5B's Q4_K_M file, whose 896-wide rows do not split into K-quant super-blocks) and of the GGUFs
llama.cpp makes most; `gguf.quants.dequantize` runs them in numpy a step at a time, and placing the embedded
models' weights spent most of its time there. Each type's maths is gguf's, op for op in float32 (d * q, then + m for
Q4_1), so the result is the same tensor. Layout, 32 values per block: Q4_0 = d float16 + 16 bytes of codes
(value (code - 8) x d), Q4_1 = d, m float16 + 16 bytes (value code x d + m), Q8_0 = d float16 + 32 int8 codes
(value code x d), Q5_0 = d float16 + 4 bytes of fifth bits (bit j of the little-endian word for value j) + 16
bytes of low nibbles (value (code - 16) x d); a 4-bit block's byte i holds value i in its low nibble and value
i + 16 in its high one.
"""
from __future__ import annotations

import numpy as np
import torch

# GGML type id -> (bytes per block, bytes before the codes)
BLOCKS = {2: (18, 2), 3: (20, 4), 6: (22, 6), 8: (34, 2)}      # Q4_0, Q4_1, Q5_0, Q8_0


def dequantize_blocks(raw: np.ndarray, ggml_type: int) -> torch.Tensor:
    """uint8 bytes of whole blocks of type `ggml_type` (a key of BLOCKS) -> float32 [blocks * 32]."""
    size, head = BLOCKS[ggml_type]
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).view(-1, size)          # [n, size] uint8, owned
    d = blocks[:, :2].contiguous().view(torch.float16).float()                           # [n, 1]
    codes = blocks[:, head:]                                                             # [n, 16 | 32]
    if ggml_type == 8:
        return (codes.contiguous().view(torch.int8).float() * d).flatten()               # [n * 32]
    q = torch.cat((codes & 0x0F, codes >> 4), dim=1)                                     # [n, 32] uint8
    if ggml_type == 2:
        return (d * (q.to(torch.int8) - 8).float()).flatten()
    if ggml_type == 6:
        high = blocks[:, 2:6].contiguous().view(torch.int32)                             # [n, 1] fifth bits
        fifth = ((high >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)     # [n, 32]
        return (d * ((q | (fifth << 4)).to(torch.int8) - 16).float()).flatten()
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()                          # [n, 1]
    return ((d * q.float()) + m).flatten()
