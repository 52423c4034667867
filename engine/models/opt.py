"""OPTForCausalLM: learned positions (offset 2), LayerNorm before or after each block
(`do_layer_norm_before`), ReLU MLP, biases, optional project_in/out when word_embed_proj_dim != hidden_size,
lm_head tied to the token embedding."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.base import LayerSpec, Weights, WeightSpec
from engine.models.config import ModelConfig
from engine.models.layers import activation, layer_norm, linear

POSITION_OFFSET = 2  # OPT's learned position table starts at index 2


class OPTFamily:
    """Pure layer functions of OPT; holds only the config."""

    # weights read only through `layers.linear`: a CPU run may hold them packed (`engine.models.cpu_linear`)
    LINEAR_WEIGHTS = frozenset({"project_in.weight", "qkv_proj.weight", "out_proj.weight", "fc1.weight",
                                "fc2.weight", "project_out.weight", "lm_head.weight"})

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.act = activation(config.hidden_act)
        self.proj_dim = config.word_embed_proj_dim or config.hidden_size

    def layer_specs(self) -> list[LayerSpec]:
        specs = [self._embed_spec()]
        for i in range(self.config.num_hidden_layers):
            specs += [self._attention_spec(i), self._mlp_spec(i)]
        return specs + [self._head_spec()]

    def _norm(self, local: str, source: str) -> dict[str, WeightSpec]:
        h = self.config.hidden_size
        return {f"{local}.weight": WeightSpec((h,), (f"{source}.weight",)),
                f"{local}.bias": WeightSpec((h,), (f"{source}.bias",))}

    def _linear(self, local: str, sources: tuple[str, ...], out: int, inp: int, bias: bool) -> dict[str, WeightSpec]:
        w = {f"{local}.weight": WeightSpec((out, inp), tuple(f"{s}.weight" for s in sources), quantizable=True)}
        if bias:
            w[f"{local}.bias"] = WeightSpec((out,), tuple(f"{s}.bias" for s in sources))
        return w

    def _embed_spec(self) -> LayerSpec:
        c = self.config
        w = {
            "embed_tokens.weight": WeightSpec((c.vocab_size, self.proj_dim), ("model.decoder.embed_tokens.weight",)),
            "embed_positions.weight": WeightSpec(
                (c.max_position_embeddings + POSITION_OFFSET, c.hidden_size), ("model.decoder.embed_positions.weight",)
            ),
        }
        if self.proj_dim != c.hidden_size:
            w.update(self._linear("project_in", ("model.decoder.project_in",), c.hidden_size, self.proj_dim, False))
        return LayerSpec("embed", "embed", -1, w)

    def _attention_spec(self, i: int) -> LayerSpec:
        c, h = self.config, self.config.hidden_size
        p = f"model.decoder.layers.{i}."
        w = self._norm("self_attn_layer_norm", f"{p}self_attn_layer_norm")
        w.update(self._linear("qkv_proj", tuple(f"{p}self_attn.{n}_proj" for n in "qkv"), 3 * h, h, c.enable_bias))
        w.update(self._linear("out_proj", (f"{p}self_attn.out_proj",), h, h, c.enable_bias))
        return LayerSpec(f"layers.{i}.self_attn", "attention", i, w)

    def _mlp_spec(self, i: int) -> LayerSpec:
        c, h = self.config, self.config.hidden_size
        p = f"model.decoder.layers.{i}."
        w = self._norm("final_layer_norm", f"{p}final_layer_norm")
        w.update(self._linear("fc1", (f"{p}fc1",), c.intermediate_size, h, c.enable_bias))
        w.update(self._linear("fc2", (f"{p}fc2",), h, c.intermediate_size, c.enable_bias))
        return LayerSpec(f"layers.{i}.mlp", "mlp", i, w)

    def _head_spec(self) -> LayerSpec:
        c = self.config
        w: dict[str, WeightSpec] = {}
        if c.do_layer_norm_before:
            w.update(self._norm("final_layer_norm", "model.decoder.final_layer_norm"))
        if self.proj_dim != c.hidden_size:
            w.update(self._linear("project_out", ("model.decoder.project_out",), self.proj_dim, c.hidden_size, False))
        source = "model.decoder.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        w["lm_head.weight"] = WeightSpec((c.vocab_size, self.proj_dim), (source,))
        return LayerSpec("head", "head", -1, w)

    def _ln(self, w: Weights, name: str, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, w[f"{name}.weight"], w[f"{name}.bias"], self.config.rms_norm_eps)

    def embed(self, w: Weights, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, w["embed_tokens.weight"])  # [b, s, proj_dim]
        if "project_in.weight" in w:
            x = linear(x, w["project_in.weight"])  # [b, s, h]
        return x + F.embedding(positions + POSITION_OFFSET, w["embed_positions.weight"])  # [b, s, h]

    def attn_qkv(
        self, w: Weights, hidden: torch.Tensor, positions: torch.Tensor, layer: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        b, s, _ = hidden.shape
        x = self._ln(w, "self_attn_layer_norm", hidden) if c.do_layer_norm_before else hidden  # [b, s, h]
        qkv = linear(x, w["qkv_proj.weight"], w.get("qkv_proj.bias"))  # [b, s, 3h]
        q, k, v = (t.view(b, s, c.num_attention_heads, c.head_dim).transpose(1, 2).contiguous()
                   for t in qkv.chunk(3, dim=-1))  # 3 x [b, nh, s, hd]
        return q, k, v

    def attn_out(self, w: Weights, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        x = residual + linear(attn, w["out_proj.weight"], w.get("out_proj.bias"))  # [b, s, h]
        return x if self.config.do_layer_norm_before else self._ln(w, "self_attn_layer_norm", x)

    def mlp(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        pre = self.config.do_layer_norm_before
        x = self._ln(w, "final_layer_norm", hidden) if pre else hidden  # [b, s, h]
        x = linear(self.act(linear(x, w["fc1.weight"], w.get("fc1.bias"))), w["fc2.weight"], w.get("fc2.bias"))
        x = hidden + x  # [b, s, h]
        return x if pre else self._ln(w, "final_layer_norm", x)

    def head(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        x = self._ln(w, "final_layer_norm", hidden) if "final_layer_norm.weight" in w else hidden  # [b, h]
        if "project_out.weight" in w:
            x = linear(x, w["project_out.weight"])  # [b, proj_dim]
        return linear(x, w["lm_head.weight"])  # [b, v]
