"""Qwen3MoeForCausalLM: Qwen3's attention (per-head q/k RMSNorm, no bias) with the Qwen sparse-MoE MLP of
qwen2_moe.py (no shared expert: shared_expert_intermediate_size is 0 in Qwen3-MoE configs)."""
from __future__ import annotations

from engine.models.qwen2_moe import Qwen2MoeFamily
from engine.models.qwen3 import Qwen3Family


class Qwen3MoeFamily(Qwen2MoeFamily, Qwen3Family):
    """MRO: the MoE MLP from Qwen2MoeFamily, q/k-normed attention from Qwen3Family, the rest from Llama."""
