"""Static description of group-wise quantization: `QuantConfig`."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantConfig:
    """Asymmetric min/scale quantization of groups of `group_size` consecutive elements along the LAST dim.

    Weights are stored [out, in] (F.linear layout), so the last dim is the input dim; the KV cache is
    [b, nkv, s, hd], so the last dim is head_dim. A last dim that is not a multiple of `group_size` is
    zero-padded to one (the padding is dropped on dequantization).
    """

    bits: int = 4
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise ValueError(f"QuantConfig.bits: only 4-bit packing is implemented, got {self.bits}")
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"QuantConfig.group_size must be an even number >= 2, got {self.group_size}")

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1
