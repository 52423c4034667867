"""DeepseekV3ForCausalLM: DeepSeek-V2's layers (engine.models.deepseek_v2) with V3's router as config data
(sigmoid scores, `e_score_correction_bias`, groups ranked by their two best scores: topk_method "noaux_tc")
and `rope_interleave` from config.json. The multi-token-prediction layers a V3 checkpoint may carry after the
last decoder layer (`num_nextn_predict_layers`, model.layers.{num_hidden_layers}...) are not used: the loader
skips their tensors."""
from __future__ import annotations

from engine.models.deepseek_v2 import DeepseekV2Family


class DeepseekV3Family(DeepseekV2Family):
    """DeepSeek-V2's MLA and MoE (inherited); V3's differences are ModelConfig fields."""

    def ignored_prefixes(self) -> tuple[str, ...]:
        """Checkpoint tensor-name prefixes no layer reads: the MTP module(s) after the last decoder layer."""
        n = self.config.num_hidden_layers
        return tuple(f"model.layers.{n + m}." for m in range(self.config.num_nextn_predict_layers))
