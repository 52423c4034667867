"""Tiny GGUF files written from a Hugging Face folder with the `gguf` package, the way llama.cpp's converter
writes them: names through gguf's own `TensorNameMap`, llama's q/k rows permuted, Gemma's norms stored as
`1 + w`, MoE experts stacked, Llama-3.1's `rope_freqs` and Phi3's LongRoPE factor tensors, metadata under
`{arch}.*` keys, a byte-level BPE (`gpt2`) or SentencePiece (`llama`) vocabulary and a chat template.

`write_gguf(folder, path, arch, qtype)` also writes `folder_rt`, the same HF folder with every tensor the
GGUF quantizes replaced by its dequantized value, so that a GGUF load can be compared with an HF load of
exactly the same weights. Q4_K has no quantizer in the python package: `quantize_q4_k` here packs llama.cpp's
block_q4_K (d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles per 256 values).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BPE_SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
BPE_MERGES = [("h", "e"), ("l", "l"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"), ("he", "ll"), ("hell", "o")]
SP_SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
SP_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "▁he", "▁hell", "▁hello", "▁w", "or",
             "▁wor", "▁world"]
VOCAB = 320   # >= every vocabulary above


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _vocab(kind: str) -> tuple[list[str], list[int], list[float], list[str]]:
    """(tokens, token types, scores, merges) padded to VOCAB with unused tokens."""
    if kind == "bpe":
        tokens = BPE_SPECIALS + list(_bytes_to_unicode().values()) + ["".join(m) for m in BPE_MERGES]
        types = [3] * len(BPE_SPECIALS) + [1] * (len(tokens) - len(BPE_SPECIALS))
        merges = [" ".join(m) for m in BPE_MERGES]
    else:
        tokens = SP_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + SP_PIECES
        types = [3, 3, 3, 2] + [6] * 256 + [1] * len(SP_PIECES)
        merges = []
    scores = [0.0] * len(SP_SPECIALS) + [-1000.0] * 256 + [-float(i) for i in range(len(tokens) - 260)]
    scores = (scores + [0.0] * len(tokens))[:len(tokens)]
    pad = VOCAB - len(tokens)
    return (tokens + [f"<unused{i}>" for i in range(pad)], types + [5] * pad, scores + [-1e4] * pad, merges)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [..., n] (n a multiple of 256) -> llama.cpp block_q4_K bytes [..., n / 256 * 144]."""
    lead, n = x.shape[:-1], x.shape[-1]
    sub = x.reshape(-1, 8, 32).astype(np.float32)                       # [blocks, 8 sub-blocks, 32]
    lo, hi = np.minimum(sub.min(-1), 0.0), sub.max(-1)                  # [blocks, 8]
    scale, mins = (hi - lo) / 15.0, -lo
    d = (scale.max(-1) / 63.0).astype(np.float16)                       # [blocks]
    dmin = (mins.max(-1) / 63.0).astype(np.float16)
    df, dmf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(mins, dmf, out=np.zeros_like(mins), where=dmf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]                                         # [blocks, 8, 1]
    q = np.clip(np.round(np.divide(sub + (dmf * mn)[..., None], step, out=np.zeros_like(sub), where=step > 0)),
                0, 15).astype(np.uint8)                                 # [blocks, 8, 32]
    scales = np.empty((sub.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)              # chunk c: sub-blocks 2c (low), 2c+1
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], -1)
    return blocks.reshape(*lead, n // 256 * 144)


def _quantize(x: np.ndarray, qtype) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return quantize_q4_k(x) if qtype == GGMLQuantizationType.Q4_K else quantize(x, qtype)


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(cfg: dict) -> list[float]:
    rs = cfg["rope_parameters"] if "rope_parameters" in cfg else cfg["rope_scaling"]
    base = rs.get("rope_theta", cfg.get("rope_theta", 10000.0))
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def write_metadata(w, arch: str, cfg: dict, tok: str) -> None:
    """Add to GGUFWriter `w` the `{arch}.*` keys of config `cfg`, the `tok` vocabulary ("bpe": byte-level BPE,
    "sp": SentencePiece) and the chat template."""
    n, h, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    if arch != "deepseek2":                                               # MLA's head dims: _deepseek2_metadata
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    rp = cfg.get("rope_parameters") or {}
    rp = rp.get("full_attention", rp)
    w.add_rope_freq_base(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rp.get("rope_type") == "linear":
        w.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rp["factor"])
    if rp.get("rope_type") == "longrope":
        orig = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / orig
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if cfg.get("sliding_window") and arch in ("gemma2", "gemma3", "phi3"):
        w.add_sliding_window(cfg["sliding_window"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            w.add_float32(f"{arch}.{key}", cfg[key])
    if arch == "gemma3":
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta", 10000.0)
        w.add_float32(f"{arch}.rope.freq_base_swa", local)
    if arch == "deepseek2":
        _deepseek2_metadata(w, cfg)
    tokens, types, scores, merges = _vocab(tok)
    w.add_tokenizer_model("gpt2" if tok == "bpe" else "llama")
    if tok == "bpe":
        w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "llama-bpe")
        w.add_token_merges(merges)
    else:
        w.add_token_scores(scores)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)


def _deepseek2_metadata(w, cfg: dict) -> None:
    """The MLA / DeepSeek-MoE keys llama.cpp's converter writes for `deepseek2` (over the generic ones)."""
    import gguf

    w.add_key_length(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_value_length(cfg["v_head_dim"])
    w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(cfg["kv_lora_rank"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
    v3 = cfg["model_type"] == "deepseek_v3"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if cfg.get("n_group"):
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    rp = cfg.get("rope_parameters") or {}
    if rp.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])


def write_gguf(folder: Path, path: Path, arch: str, qtype, tok: str = "bpe") -> Path:
    """Write the HF `folder` as a GGUF at `path` (2-D weights whose rows are whole blocks in `qtype`, the rest
    F32, as llama.cpp falls back); return `folder_rt`, the HF folder of the GGUF's dequantized weights."""
    import gguf
    from gguf.quants import dequantize

    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    arch_enum = {a: e for e, a in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_enum, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), arch)
    write_metadata(w, arch, cfg, tok)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    roundtrip: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}

    def add(gname: str, t: torch.Tensor, hf: list[str]) -> None:
        x = t.float().numpy()
        if x.ndim >= 2 and x.shape[-1] % block == 0:
            q = _quantize(x, qtype)
            w.add_tensor(gname, q, raw_dtype=qtype)
            x = dequantize(q, qtype).reshape(x.shape)
        else:
            w.add_tensor(gname, x)
        back = torch.from_numpy(np.ascontiguousarray(x))
        if len(hf) > 1:
            roundtrip.update({n: back[j].clone() for j, n in enumerate(hf)})
        elif hf:
            roundtrip[hf[0]] = back

    for name, t in state.items():
        parts = name.split(".")
        if "experts" in parts:                                   # model.layers.i.mlp.experts.j.<w>_proj.weight
            i, j, kind = parts[2], int(parts[5]), parts[6].removesuffix("_proj")
            experts.setdefault(f"blk.{i}.ffn_{kind}_exps.weight", {})[j] = t
            continue
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if name.endswith("gate.e_score_correction_bias"):                # llama.cpp: blk.N.exp_probs_b.bias
            gname = f"blk.{parts[2]}.exp_probs_b.bias"
        assert gname is not None, name
        data = t.float()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _permute(data, heads if "q_proj" in name else kv)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1
        add(gname, data, [])
        roundtrip[name] = t.float() if data.dim() < 2 or data.shape[-1] % block else None  # filled below
        if roundtrip[name] is None:
            deq = torch.from_numpy(dequantize(_quantize(t.float().numpy(), qtype), qtype).reshape(t.shape).copy())
            roundtrip[name] = deq                                # quantization is per row: permutation-free
    for gname, by_j in experts.items():
        i, kind = gname.split(".")[1], gname.split("_")[1]
        hf = [f"model.layers.{i}.mlp.experts.{j}.{kind}_proj.weight" for j in sorted(by_j)]
        add(gname, torch.stack([by_j[j] for j in sorted(by_j)]).float(), hf)
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rp.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", np.array(_llama3_factors(cfg), dtype=np.float32))
    if rp.get("rope_type") == "longrope":
        w.add_tensor("rope_factors_long.weight", np.array(rp["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rp["short_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    rt = folder.parent / f"{folder.name}_rt"
    rt.mkdir(exist_ok=True)
    shutil.copy(folder / "config.json", rt / "config.json")
    save_file({k: v.contiguous() for k, v in roundtrip.items()}, str(rt / "model.safetensors"))
    return rt
