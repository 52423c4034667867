"""A model's `engine.policy.layout.ModelLayout`, read off its family's layer specs.

The policy package plans memory from pure data and never builds a model; this module is where that data comes
from: the layer specs in the executor's order, each tensor's shape, the 4-bit grouping it is held in with
and without compression (`engine.models.weights.stored_quant`) and whether the family reads it only as a
matmul's weight (its `LINEAR_WEIGHTS`, which a CPU run holds packed), and a MoE model's expert group buffers
(`engine.models.moe`). The executor builds its own layout (its specs, its dtype and weight compression); a
planner without a loaded model builds one from the config.
"""
from __future__ import annotations

from typing import Sequence

import torch

from engine.models.base import LayerSpec
from engine.models.config import ModelConfig
from engine.models.moe import EXPERT_GROUP_BYTES, expert_slot_bytes
from engine.models.registry import build_family
from engine.models.weights import stored_quant, weight_quant
from engine.policy.dtypes import dtype_name, dtype_of_size
from engine.policy.layout import ExpertBuffers, LayerLayout, ModelLayout, TensorLayout
from engine.quant.config import QuantConfig


def expert_buffers(config: ModelConfig) -> ExpertBuffers | None:
    """The padded buffers of one expert group of `moe_experts` for `config` (None for a dense model)."""
    if not config.is_moe:
        return None
    return ExpertBuffers(expert_slot_bytes(config.hidden_size, config.expert_intermediate_size, 1), EXPERT_GROUP_BYTES)


def model_layout(config: ModelConfig, dtype: torch.dtype | str | int = 2, compress_weights: bool = False, *,
                 specs: Sequence[LayerSpec] | None = None, quant: QuantConfig | None = None) -> ModelLayout:
    """The layout of `config`'s weights in `dtype` (a dtype, its name, or bytes per element: 2 counts as
    float16) with `compress_weights`. `specs`: the layer specs an executor runs (default: the whole model's);
    `quant`: the grouping `compress_weights` holds quantizable weights in (default the model's, `weight_quant`)."""
    family = build_family(config)
    specs = family.layer_specs() if specs is None else specs
    compress = quant or weight_quant(config)
    linear = getattr(family, "LINEAR_WEIGHTS", frozenset())
    layers = tuple(
        LayerLayout(spec.name, spec.kind, spec.index, tuple(
            TensorLayout(name, tuple(w.shape), stored_quant(config, w, None), stored_quant(config, w, compress),
                         name in linear and len(w.shape) == 2)
            for name, w in spec.weights.items()))
        for spec in specs)
    name = dtype_of_size(dtype) if isinstance(dtype, int) else dtype_name(dtype)
    return ModelLayout(layers, name, compress_weights, config.is_moe, expert_buffers(config))
