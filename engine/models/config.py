"""Static description of a model: `ModelConfig`, with Hugging Face field names.

Built from a checkpoint's config.json (`engine.models.hf_config.config_from_hf`), GGUF metadata or a named
preset. Only what our layers need is kept; every family reads the same dataclass. Per-layer facts the
runtime needs (a layer's sliding window, whether its MLP is sparse) are methods here, so the executor never
asks a family.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.models.int4_config import Int4Config


@dataclass(frozen=True)
class ModelConfig:
    architecture: str                    # the HF `architectures[0]` string, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int               # OPT: ffn_dim
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6           # OPT: layer_norm eps 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False         # Qwen2: True (q/k/v bias only)
    hidden_act: str = "silu"             # OPT: "relu"
    # OPT only
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None
    enable_bias: bool = True
    # attention variants (Mistral, Qwen2/3, Phi3, Gemma2/3)
    sliding_window: int | None = None    # keys more than this many positions back are masked
    layer_types: tuple[str, ...] = ()    # per layer "sliding_attention" | "full_attention"; () = all sliding
                                         # when sliding_window is set (Mistral), else all full
    attn_logit_softcapping: float | None = None   # Gemma2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma2: logits -> cap * tanh(logits / cap)
    query_pre_attn_scalar: float | None = None    # Gemma: attention scale is query_pre_attn_scalar ** -0.5
    rope_local_base_freq: float | None = None     # Gemma3: rope_theta of the sliding-window layers
    # sparse MoE (Mixtral, Qwen2-MoE, Qwen3-MoE)
    num_local_experts: int = 0           # Qwen-MoE: num_experts
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0       # Qwen-MoE: each routed expert's width (0 = intermediate_size)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: the sigmoid-gated shared expert (0 = none)
    norm_topk_prob: bool = True          # renormalise the top-k routing weights to sum 1 (Mixtral: always)
    decoder_sparse_step: int = 1         # layer i is sparse when (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()
    # DeepSeek-V2/V3: multi-head latent attention (MLA; kv_lora_rank > 0 marks it). The cache holds full
    # per-head K and V after the up-projection, V zero-padded to head_dim = max(qk_nope + qk_rope, v_head_dim)
    q_lora_rank: int | None = None       # None: a plain q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False        # RoPE over interleaved pairs (x0, x1), (x2, x3)... (DeepSeek)
    # DeepSeek MoE: shared experts (n x moe_intermediate_size, ungated), dense layers first, routing
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0       # layers [0, k) have a dense MLP of intermediate_size
    moe_layer_freq: int = 1              # and layers i >= k with i % freq != 0
    scoring_func: str = "softmax"        # router scores: "softmax" (V2) | "sigmoid" (V3, with a correction bias)
    topk_method: str = "greedy"          # "greedy" | "group_limited_greedy" (V2) | "noaux_tc" (V3)
    n_group: int = 1                     # experts in n_group groups; only the best topk_group groups are routed to
    topk_group: int = 1
    routed_scaling_factor: float = 1.0   # routed experts' weights times this
    num_nextn_predict_layers: int = 0    # V3's multi-token-prediction layers after the last one (not run)
    # tokens
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int | None = None
    torch_dtype: str = "float32"         # the checkpoint's dtype
    # an AWQ / GPTQ int4 checkpoint's quantization_config (None: float weights); its decoder matmul weights
    # are held in the checkpoint's own 4-bit groups on every tier (engine.models.weights.stored_quant)
    quantization_config: Int4Config | None = None
    # the groups (inputs per min/scale pair) compress_weights quantizes the other matmul weights in: 64 for a
    # float checkpoint or a preset, the source's grid for a GGUF (32: `engine.quant.config.GGUF_WEIGHT_QUANT`,
    # set by the loader); `engine.models.weights.weight_quant`
    weight_group_size: int = 64

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attn_scale(self) -> float:
        """Softmax scale: query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5; MLA: (qk_nope +
        qk_rope) ** -0.5 times YaRN's mscale(factor, mscale_all_dim) ** 2 (DeepSeek)."""
        if self.is_mla:
            scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
            r = self.rope_scaling or {}
            m_all, factor = float(r.get("mscale_all_dim") or 0.0), float(r.get("factor") or 1.0)
            if r.get("rope_type") == "yarn" and m_all and factor > 1:
                scale *= (0.1 * m_all * math.log(factor) + 1.0) ** 2
            return scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def expert_intermediate_size(self) -> int:
        """Width of one routed expert."""
        return self.moe_intermediate_size or self.intermediate_size

    def layer_window(self, i: int) -> int | None:
        """Sliding window of decoder layer i (None: full causal attention)."""
        if self.sliding_window is None:
            return None
        if not self.layer_types or self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    def is_moe_layer(self, i: int) -> bool:
        """True when decoder layer i has a sparse-MoE block (else a dense MLP of intermediate_size)."""
        return (self.is_moe and i not in self.mlp_only_layers
                and (i + 1) % max(1, self.decoder_sparse_step) == 0
                and i >= self.first_k_dense_replace and i % max(1, self.moe_layer_freq) == 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
