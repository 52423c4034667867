"""Static description of a model: `ModelConfig`, with Hugging Face field names.

Built from a checkpoint's config.json (`engine.models.hf_config.config_from_hf`), GGUF metadata or a named preset. Only what our layers
need is kept; every family reads the same dataclass.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
    # Mixtral only
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    # tokens
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int | None = None
    torch_dtype: str = "float32"         # the checkpoint's dtype

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @property
    def attn_scale(self) -> float:
        return self.head_dim ** -0.5

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
