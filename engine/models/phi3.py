"""Phi3ForCausalLM: a Llama-shaped decoder whose checkpoint already holds q/k/v fused (`self_attn.qkv_proj`)
and gate/up fused (`mlp.gate_up_proj`): the packed-weights map `PACKED` names them as single sources, so the
fused tensors load as they are and execute fused through the Llama layers. RoPE: default, "linear" or
LongRoPE ("longrope"/"su": short factors below original_max_position_embeddings, long factors from there on,
cos/sin times the attention factor; engine.models.layers.rope_table). A `sliding_window` in config.json is
applied to every layer, as transformers' Phi3 does. partial_rotary_factor < 1 (Phi-4-mini) is refused.
"""
from __future__ import annotations

from engine.models.llama import LlamaFamily


class Phi3Family(LlamaFamily):
    """Llama layers (inherited) over Phi3's pre-fused checkpoint tensors."""

    PACKED = {"qkv_proj": ("qkv_proj",), "gate_up_proj": ("gate_up_proj",)}
