"""Static description of group-wise quantization: `QuantConfig`, and the engine's defaults."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantConfig:
    """Asymmetric min/scale quantization of groups of `group_size` consecutive elements along the LAST dim.

    Weights are stored [out, in] (F.linear layout), so the last dim is the input dim; the KV cache is
    [b, nkv, s, hd], so the last dim is head_dim. A last dim that is not a multiple of `group_size` is
    zero-padded to one (the padding is dropped on dequantization).

    `rotate`: each group is multiplied by the normalized Hadamard matrix H (symmetric, orthonormal:
    H @ H = I) before quantizing, and dequantization multiplies by H again. The rotation spreads a few
    large channels (the key outliers of rotary attention) over the whole group, so the group's range, and
    with it the step, shrinks (QuaRot / QuIP#). Needs a power-of-two `group_size`.
    """

    bits: int = 4
    group_size: int = 64
    rotate: bool = False

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise ValueError(f"QuantConfig.bits: only 4-bit packing is implemented, got {self.bits}")
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"QuantConfig.group_size must be an even number >= 2, got {self.group_size}")
        if self.rotate and self.group_size & (self.group_size - 1):
            raise ValueError(f"QuantConfig.rotate needs a power-of-two group_size, got {self.group_size}")

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def tag(self) -> str:
        """A short name for file/folder names: `q4g64`, `q4g64r` (rotated)."""
        return f"q{self.bits}g{self.group_size}{'r' if self.rotate else ''}"


# The CPU int4 kernel (`torch.ops.aten._weight_int4pack_mm_for_cpu`, run by `engine.models.cpu_linear.Int4Linear`):
# the group sizes it takes, and the operands a 4-bit matrix becomes for it, beside its QTensor.
INT4_KERNEL_GROUPS = (32, 64, 128, 256)


def int4_kernel_parts(shape: tuple[int, ...], dtype: str,
                      quant: QuantConfig | None) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """The (suffix, shape, dtype name) of the int4 kernel's operands for a 4-bit matrix of logical `shape`
    [n, k] held in `dtype` with `quant`'s groups: its codes repacked [n, k/2] uint8 and its scales and zeros
    [k/group, n, 2] bfloat16; () when the kernel does not take it (not 2-D, not bfloat16, dense, rotated,
    or groups it does not support or that do not tile k)."""
    if (quant is None or len(shape) != 2 or dtype != "bfloat16" or quant.rotate
            or quant.group_size not in INT4_KERNEL_GROUPS or shape[1] % quant.group_size):
        return ()
    n, k = shape
    return (("codes", (n, k // 2), "uint8"), ("scales", (k // quant.group_size, n, 2), "bfloat16"))


# Defaults. Weights: groups by source (`engine.models.weights.weight_quant`, `ModelConfig.weight_group_size`).
# Float checkpoints (and dummy presets): groups of 64, FlexGen's (4.5 bits per weight with
# float16 min/scale); groups of 32 are not measured against them on a real float checkpoint. A GGUF's
# projections: groups of 32 (GGUF_WEIGHT_QUANT), chosen by benchmarks/accuracy/quant_perplexity.py (SmolLM2-135M, fp32,
# 768 tokens of sample_data text scored after 256-token prompts):
# SmolLM2's are llama.cpp Q4_1 (min/scale per 32 inputs), and groups of 32 land on that grid and re-quantize
# them exactly (perplexity +0.0%, mean KL 0.0; the output head stays dense), while groups of 64 straddle two
# grids (+26.7%, weights alone). llama.cpp's Q4_0, Q4_1 and Q8_0 blocks are 32 wide, the K-quants' sub-blocks
# 16 or 32. Not rotated: a rotated group leaves the grid (`--variants weights_g32_rot`). Cost: 5 instead of
# 4.5 bits per weight, 11% more bytes to hold and stream.
WEIGHT_QUANT = QuantConfig(group_size=64)
GGUF_WEIGHT_QUANT = QuantConfig(group_size=32)
# KV cache: groups of 64 (a whole head for head_dim 64) rotated by a Hadamard matrix, which spreads the
# outlier channels of rotary keys: perplexity +6.7% -> +3.2%, mean KL 0.083 -> 0.028 nats/token against plain
# groups of 64. Rotated groups of 32 are a little more accurate (+2.5%, KL 0.018) for 11% more cache bytes.
CACHE_QUANT = QuantConfig(group_size=64, rotate=True)
