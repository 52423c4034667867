"""Sizes and work of a model, from its `ModelConfig` alone: weight elements/bytes per decoder layer, KV bytes
per token, FLOPs per token (dense and activated experts). Pure functions; no tensors are built.

Conventions: a "decoder layer" is one attention block plus one MLP (or sparse-MoE) block, with their norms
and biases. Element counts are exact for the families we implement (OPT, Llama-shaped, Mixtral, Qwen3,
Qwen-MoE with routed experts of `moe_intermediate_size` and a shared expert, Gemma2/3 with their extra norms,
Phi3, DeepSeek-V2/V3 with MLA projections, shared experts and V3's router bias); the per-layer functions
take an optional decoder-layer index: without it, an MoE model's layer is counted as sparse (an upper bound
for models with dense layers: `mlp_only_layers`, `decoder_sparse_step`, DeepSeek's `first_k_dense_replace`),
with it the layer as it is; `total_numel` sums the layers exactly. Byte
counts multiply by `bytes_per_element`, and `compressed_bytes` gives the 4-bit group-wise size
(4 bits per value plus an fp16 min and scale per group of 64: 36 / 128 = 0.28x of fp16). An int4 checkpoint's
matmul weights (`config.quantization_config`) count in its own groups (whole-row groups as hidden_size inputs)
with or without `compress`; the exact per-tensor sizes are the model's `engine.policy.layout.ModelLayout`.
"""
from __future__ import annotations

from typing import Any

from engine.policy.dtypes import element_size
from engine.policy.layout import ModelConfig

QUANT_GROUP_SIZE = 64
QUANT_BITS = 4
QUANT_SCALE_BYTES = 2  # min and scale are stored in fp16, one pair per group


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a floating dtype (torch dtype or name like "float16")."""
    return element_size(dtype)


def _is_opt(config: ModelConfig) -> bool:
    return config.architecture.startswith("OPT")


def _is_gemma(config: ModelConfig) -> bool:
    return config.architecture.startswith("Gemma")


_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")   # per-head q/k RMSNorm weights


def _mla_matmul_numel(c: ModelConfig) -> int:
    """MLA's projections: q (through the q LoRA when there is one), kv_a (latent + shared rope key), kv_b, o."""
    h, nh, qk = c.hidden_size, c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    q = h * c.q_lora_rank + c.q_lora_rank * nh * qk if c.q_lora_rank else h * nh * qk
    kv = h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * nh * (c.qk_nope_head_dim + c.v_head_dim)
    return q + kv + nh * c.v_head_dim * h


def attention_matmul_numel(config: ModelConfig) -> int:
    """Elements of the q/k/v/o projection matrices of one layer (quantizable)."""
    if config.is_mla:
        return _mla_matmul_numel(config)
    h, q_dim = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    return h * q_dim + 2 * h * kv_dim + q_dim * h  # q_proj, k_proj + v_proj, o_proj


def attention_other_numel(config: ModelConfig) -> int:
    """Elements of one attention block's norm and biases (kept uncompressed)."""
    h, q_dim = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    if _is_opt(config):
        bias = (q_dim + 2 * kv_dim + h) if config.enable_bias else 0
        return bias + 2 * h  # biases + layer norm weight and bias
    if config.is_mla:
        return h + (config.q_lora_rank or 0) + config.kv_lora_rank  # input, q_a and kv_a RMSNorms
    bias = (q_dim + 2 * kv_dim) if config.attention_bias else 0
    qk_norm = 2 * config.head_dim if config.architecture in _QK_NORM else 0
    post = h if _is_gemma(config) else 0   # Gemma's post_attention_layernorm (on the attention output)
    return bias + h + qk_norm + post  # q/k/v biases + RMSNorm weight(s)


def expert_numel(config: ModelConfig) -> int:
    """Elements of one feed-forward network (one routed expert for MoE): gate/up/down for gated MLPs,
    fc1/fc2 (+biases) for OPT."""
    h, i = config.hidden_size, config.intermediate_size
    if _is_opt(config):
        return 2 * h * i + ((i + h) if config.enable_bias else 0)
    return 3 * h * (config.expert_intermediate_size if config.is_moe else i)


def _shared_expert_numel(config: ModelConfig) -> int:
    """Elements of Qwen2-MoE's shared expert and its sigmoid gate, or of DeepSeek's ungated shared experts
    (0 without one)."""
    if config.n_shared_experts:
        return 3 * config.hidden_size * config.n_shared_experts * config.expert_intermediate_size
    si = config.shared_expert_intermediate_size
    return 3 * config.hidden_size * si + config.hidden_size if si else 0


def _sparse(config: ModelConfig, layer: int | None) -> bool:
    return config.is_moe and (layer is None or config.is_moe_layer(layer))


def mlp_matmul_numel(config: ModelConfig, layer: int | None = None) -> int:
    """Elements of one MLP block's matrices: all experts for MoE (plus the router and a shared expert),
    else one FFN (decoder layer `layer` as it is; None: sparse for an MoE model)."""
    h, i = config.hidden_size, config.intermediate_size
    ffn_matmul = (2 if _is_opt(config) else 3) * h * i
    if _sparse(config, layer):
        e = config.num_local_experts
        return e * expert_numel(config) + h * e + _shared_expert_numel(config)  # experts + router + shared
    return ffn_matmul


def mlp_other_numel(config: ModelConfig, layer: int | None = None) -> int:
    """Elements of one MLP block's norm and biases (DeepSeek-V3's router correction bias on sparse layers)."""
    h, i = config.hidden_size, config.intermediate_size
    if _is_opt(config):
        return ((i + h) if config.enable_bias else 0) + 2 * h
    bias = config.num_local_experts if config.scoring_func == "sigmoid" and _sparse(config, layer) else 0
    return bias + (2 * h if _is_gemma(config) else h)   # Gemma: pre_ and post_feedforward_layernorm


def layer_numel(config: ModelConfig, layer: int | None = None) -> int:
    """Elements of one decoder layer (attention + MLP/experts, norms and biases); `layer` as in mlp_matmul_numel."""
    return (attention_matmul_numel(config) + attention_other_numel(config)
            + mlp_matmul_numel(config, layer) + mlp_other_numel(config, layer))


def embed_numel(config: ModelConfig) -> int:
    """Elements of the embedding stage: token embeddings (+ OPT's learned positions and projections)."""
    h = config.hidden_size
    d = config.word_embed_proj_dim or h
    n = config.vocab_size * d
    if _is_opt(config):
        n += (config.max_position_embeddings + 2) * h  # learned positions (offset 2)
        if d != h:
            n += 2 * d * h  # project_in / project_out
    return n


def head_numel(config: ModelConfig) -> int:
    """Elements of the head stage: final norm + lm_head (0 extra for tied embeddings)."""
    h = config.hidden_size
    norm = 2 * h if _is_opt(config) else h
    if config.tie_word_embeddings or _is_opt(config):  # OPT ties lm_head to embed_tokens
        return norm
    return norm + config.vocab_size * h


def total_numel(config: ModelConfig) -> int:
    """All parameters of the model."""
    layers = sum(layer_numel(config, i) for i in range(config.num_hidden_layers))
    return embed_numel(config) + layers + head_numel(config)


def compressed_bytes(numel: int | float) -> float:
    """Bytes of `numel` values stored 4-bit group-wise: numel / 2 + 2 fp16 scalars per group of 64."""
    return numel * QUANT_BITS / 8 + numel / QUANT_GROUP_SIZE * 2 * QUANT_SCALE_BYTES


def matmul_bytes(config: ModelConfig, numel: int | float, bytes_per_element: int, compress: bool) -> float:
    """Stored bytes of `numel` matmul-weight values: an int4 checkpoint's groups (min/scale in float16 for
    half dtypes, else float32), else 4-bit with `compress`, else dense."""
    q = config.quantization_config
    if q is not None:
        scale_bytes = 2 if bytes_per_element <= 2 else 4
        return numel * QUANT_BITS / 8 + numel / (q.group_size or config.hidden_size) * 2 * scale_bytes
    return compressed_bytes(numel) if compress else numel * bytes_per_element


def layer_weight_bytes(config: ModelConfig, bytes_per_element: int, compress: bool = False) -> float:
    """Stored bytes of one decoder layer; with `compress` (or from an int4 checkpoint), matmul weights are
    4-bit, norms/biases not."""
    matmul = attention_matmul_numel(config) + mlp_matmul_numel(config)
    other = attention_other_numel(config) + mlp_other_numel(config)
    return matmul_bytes(config, matmul, bytes_per_element, compress) + other * bytes_per_element


def layer_dense_bytes(config: ModelConfig, bytes_per_element: int) -> float:
    """Bytes of one decoder layer's weights dense in `bytes_per_element` (what its matmuls read, after any
    dequantization)."""
    return layer_numel(config) * bytes_per_element


def edge_weight_bytes(config: ModelConfig, bytes_per_element: int) -> float:
    """Bytes of embed + head (never compressed: the embedding is a lookup, the head small next to layers)."""
    return (embed_numel(config) + head_numel(config)) * bytes_per_element


def largest_stage_bytes(config: ModelConfig, bytes_per_element: int, compress: bool = False) -> float:
    """Stored bytes of the biggest single stage the runtime loads at once (FlexGen's layer granularity:
    an attention block, an MLP block, the embedding or the lm_head): the size of one in-flight buffer."""
    B = bytes_per_element

    def stored(matmul: int, other: int) -> float:
        return matmul_bytes(config, matmul, B, compress) + other * B

    head_matrix = 0 if (config.tie_word_embeddings or _is_opt(config)) else config.vocab_size * config.hidden_size
    return max(stored(attention_matmul_numel(config), attention_other_numel(config)),
               stored(mlp_matmul_numel(config), mlp_other_numel(config)),
               embed_numel(config) * B, head_matrix * B)


def kv_bytes_per_token(config: ModelConfig, bytes_per_element: int, compress: bool = False) -> float:
    """KV-cache bytes one token adds to ONE layer: k and v, num_key_value_heads x head_dim each."""
    numel = 2 * config.num_key_value_heads * config.head_dim
    return compressed_bytes(numel) if compress else numel * bytes_per_element


def hidden_bytes_per_token(config: ModelConfig, bytes_per_element: int) -> float:
    """Bytes of one token's hidden state between layers: hidden_size values."""
    return config.hidden_size * bytes_per_element


def active_matmul_numel(config: ModelConfig) -> int:
    """Matrix elements one token multiplies through in one layer: attention projections + the router and
    `num_experts_per_tok` experts for MoE (activated experts), else the whole MLP."""
    if config.is_moe:
        h, k = config.hidden_size, config.num_experts_per_tok
        return (attention_matmul_numel(config) + h * config.num_local_experts + k * expert_numel(config)
                + _shared_expert_numel(config))
    return attention_matmul_numel(config) + mlp_matmul_numel(config)


def matmul_flops_per_token(config: ModelConfig) -> float:
    """FLOPs of one token through one layer's matmuls: 2 per multiply-add over the activated weights."""
    return 2.0 * active_matmul_numel(config)


def dense_flops_per_token(config: ModelConfig) -> float:
    """FLOPs of one token through one layer if every expert ran (the dense upper bound)."""
    return 2.0 * (attention_matmul_numel(config) + mlp_matmul_numel(config))


def attention_flops_per_token(config: ModelConfig, context_len: float) -> float:
    """FLOPs of one query token's attention core in one layer over `context_len` cached tokens:
    q.k^T and p.v, 2 FLOPs per multiply-add each, over num_attention_heads x head_dim."""
    return 4.0 * config.num_attention_heads * config.head_dim * context_len


def head_flops_per_token(config: ModelConfig) -> float:
    """FLOPs of the lm_head for one position: 2 x hidden (or proj dim) x vocab."""
    d = config.word_embed_proj_dim or config.hidden_size
    return 2.0 * d * config.vocab_size


def attention_operational_intensity(config: ModelConfig, bytes_per_element: int, compress: bool = False) -> float:
    """FLOPs per byte of KV cache read by decode attention (independent of batch and length):
    4 nh hd FLOPs per token against kv_bytes_per_token bytes. ~1-4 for GQA models: far below any GPU's
    ridge point, hence memory-bound wherever it runs (MoE-Lightning's case for host attention)."""
    return attention_flops_per_token(config, 1.0) / kv_bytes_per_token(config, bytes_per_element, compress)


def activation_bytes_per_token(config: ModelConfig, bytes_per_element: int) -> float:
    """Bytes one token's activations move through one layer's elementwise passes, read and written: two norms,
    the rotary of q and k, the attention output, two residual adds and the MLP's activation (gate and up read,
    their product written; per routed expert for MoE, with the token's copy in, its output out and the routing
    weight's product; OPT has no rotary, and its ungated activation reads and writes the intermediate once).
    Memory-bound work the matmul roofline does not count."""
    h, a = config.hidden_size, config.num_attention_heads * config.head_dim
    rotary = 0 if _is_opt(config) else 2 * (a + config.num_key_value_heads * config.head_dim)
    if config.is_moe:
        mlp = config.num_experts_per_tok * (3 * config.expert_intermediate_size + 3 * h)
    else:
        mlp = (2 if _is_opt(config) else 3) * config.intermediate_size
    return (4 * h + rotary + a + 6 * h + mlp) * bytes_per_element
