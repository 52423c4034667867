"""The placement decision: batch shape, tier fractions and flags (FlexGen's Policy, in fractions).

A `Policy` is frozen data. The disk share of each tensor class is derived (1 - gpu - cpu), never stored,
so the three shares always sum to one; a negative derived share is an error at construction.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

_EPS = 1e-9


@dataclass(frozen=True)
class Policy:
    """How one block of `num_gpu_batches x gpu_batch_size` sequences is placed and run.

    Fractions are in [0, 1]: `w_*` of each layer's weight bytes (by cumulative tensor size),
    `cache_*` of each GPU batch's KV cache, `act_*` of each GPU batch's hidden states.
    `w_gpu_extra`: that many more whole tensors on the gpu, the first tensor the fractions leave off the gpu in
    each of the first `w_gpu_extra` layers (in the executor's layer order) that have one
    (`engine.policy.placement.with_extra`): the search fills the device memory a per-layer share leaves with
    them, since the next share moves one tensor in every layer (a third of Mixtral-8x7B's experts, 7.9 GiB).

    MoE models (`engine.runtime.moe_schedule`): `pipeline` runs MoE-Lightning's CGOPipe: with `cpu_attention`,
    the host attention of GPU batch k runs on a host thread while the device runs the router and experts of
    the batches before it, and a layer's weights move in `weight_pages` pages (0: one per GPU batch) spread
    over the previous layer's GPU batches. `pipeline=False` is the ablation: host attention synchronous and
    every layer's weights in one transfer. Dense models ignore both (their weights move in one page per GPU
    batch).

    `prefill_ahead`: while a block decodes, the next block's prefill runs in row chunks on the decode steps'
    weight passes (`engine.runtime.ahead`), its cache's gpu share parked on the host until the switch; a
    block with a shared prefix, and the first block, run their own prefill.

    `compress_weights`: decoder matmul weights held 4-bit in the model's groups
    (`engine.models.weights.weight_quant`: 64, a GGUF's 32). An AWQ / GPTQ int4 checkpoint's packed weights are
    held 4-bit in its own groups either way (`engine.models.weights.stored_quant`).

    `cpu_dense_copy` (a CPU run's; an executor on another device refuses it): each 4-bit matmul weight the
    int4 kernel takes is also held dense, bfloat16 reordered once into oneDNN's layout
    (`engine.models.cpu_linear.dense_copy`), and multiplies through it past the kernel's crossing (a prefill, a
    large decode batch) instead of dequantizing on every call. The products are the same bits; it costs a
    bfloat16 matrix more per weight, which the buffer plan counts (`packed.{layer}.{tensor}.dense`).
    """

    gpu_batch_size: int = 32
    num_gpu_batches: int = 1
    w_gpu: float = 1.0
    w_cpu: float = 0.0
    cache_gpu: float = 1.0
    cache_cpu: float = 0.0
    act_gpu: float = 1.0
    act_cpu: float = 0.0
    overlap: bool = True
    cpu_attention: bool = False
    compress_weights: bool = False
    compress_cache: bool = False
    cpu_dense_copy: bool = False
    pipeline: bool = True
    weight_pages: int = 0
    prefill_ahead: bool = False
    w_gpu_extra: int = 0

    def __post_init__(self) -> None:
        if self.gpu_batch_size < 1 or self.num_gpu_batches < 1:
            raise ValueError(
                f"Policy: gpu_batch_size and num_gpu_batches must be >= 1, "
                f"got {self.gpu_batch_size} and {self.num_gpu_batches}"
            )
        if self.w_gpu_extra < 0:
            raise ValueError(f"Policy.w_gpu_extra must be >= 0, got {self.w_gpu_extra}")
        if self.weight_pages < 0:
            raise ValueError(f"Policy.weight_pages must be >= 0 (0: one page per GPU batch), got {self.weight_pages}")
        for name in ("w", "cache", "act"):
            gpu, cpu = getattr(self, f"{name}_gpu"), getattr(self, f"{name}_cpu")
            for field_name, value in ((f"{name}_gpu", gpu), (f"{name}_cpu", cpu)):
                if not 0.0 <= value <= 1.0:
                    raise ValueError(f"Policy.{field_name} must be in [0, 1], got {value}")
            if gpu + cpu > 1.0 + _EPS:
                raise ValueError(
                    f"Policy: {name}_gpu + {name}_cpu = {gpu + cpu:.4f} > 1, so {name}_disk would be negative"
                )

    @property
    def w_disk(self) -> float:
        return max(0.0, 1.0 - self.w_gpu - self.w_cpu)

    @property
    def cache_disk(self) -> float:
        return max(0.0, 1.0 - self.cache_gpu - self.cache_cpu)

    @property
    def act_disk(self) -> float:
        return max(0.0, 1.0 - self.act_gpu - self.act_cpu)

    @property
    def block_size(self) -> int:
        """Sequences in one block: num_gpu_batches x gpu_batch_size."""
        return self.gpu_batch_size * self.num_gpu_batches

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Policy":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Policy: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


def as_policy(value: Any) -> str | Policy:
    """A policy setting as the engine takes it: "auto", a Policy, or a mapping of Policy fields as a Policy.
    Anything else, an unknown field or an invalid value, is a ValueError saying what is wrong."""
    if value == "auto" or isinstance(value, Policy):
        return value
    if isinstance(value, dict):
        try:
            return Policy.from_dict(dict(value))
        except TypeError as exc:
            raise ValueError(f"Policy: {exc}") from None
    raise ValueError(f"expected 'auto', a Policy or a mapping of Policy fields, got {value!r}")
