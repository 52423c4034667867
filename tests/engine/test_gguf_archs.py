"""GGUF files of every supported architecture and quant type against the HF folder of the same weights.

Each case: a tiny random transformers checkpoint (`save_pretrained`), written as a GGUF by helpers/gguf_tiny.py
in llama.cpp's naming and conventions (q/k permutation for llama, Gemma's `1 + w` norms, stacked experts,
Llama-3.1 `rope_freqs`, Phi3 LongRoPE factor tensors). Through the executor (prefill + decode steps, prompts
longer than the sliding windows), the GGUF's logits equal those of the HF folder holding the GGUF's
dequantized weights within 1e-4 (fp32: only the mapping is under test) and stay within the quantization
error of the original checkpoint's; tokenizers and chat template come from the GGUF metadata.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from engine.models.loader import load_model  # noqa: E402
from engine.policy.policy import Policy  # noqa: E402
from engine.quant.qtensor import QTensor  # noqa: E402
from engine.runtime.executor import Executor  # noqa: E402
from engine.runtime.layout import model_layout  # noqa: E402
from helpers.gguf_tiny import VOCAB, write_gguf  # noqa: E402
from helpers.greedy_runs import make_prompts, run_logits  # noqa: E402

Q = gguf.GGMLQuantizationType
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_LLAMA3 = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=16)
_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.1 * i for i in range(8)],
                 long_factor=[2.0 + 0.5 * i for i in range(8)])
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, mscale=0.707,
             mscale_all_dim=0.707, beta_fast=32, beta_slow=1)
# GGUF arch -> (transformers config class, overrides, tokenizer kind)
ARCHS: dict[str, tuple[str, dict, str]] = {
    "llama": ("LlamaConfig", dict(rope_parameters=_LLAMA3), "bpe"),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), "bpe"),
    "qwen3": ("Qwen3Config", dict(head_dim=32), "bpe"),
    "qwen2moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=64, norm_topk_prob=False), "bpe"),
    "qwen3moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        norm_topk_prob=True, head_dim=32), "bpe"),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                    num_hidden_layers=3), "sp"),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16, num_hidden_layers=6,
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 1e5},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 1e4}}), "sp"),
    "phi3": ("Phi3Config", dict(rope_parameters=_LONGROPE, original_max_position_embeddings=16), "sp"),
    "deepseek2": ("DeepseekV2Config", dict(moe_intermediate_size=32, num_key_value_heads=4, kv_lora_rank=32,
                                           q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                           first_k_dense_replace=1, num_hidden_layers=3, routed_scaling_factor=1.5,
                                           rope_parameters=_YARN), "bpe"),
}
QTYPES = {"Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0}
# quantization error of the prefill logits against the unquantized checkpoint (relative L2). Measured on
# these random tiny models: Q8_0 0.007-0.031, Q4_0 0.12-0.45, Q4_K 0.20-0.42 (gemma3, 6 layers, the most)
LOOSE = {"Q8_0": 0.05, "Q4_0": 0.6, "Q4_K": 0.6}


def build_checkpoint(arch: str, folder: Path, **extra) -> Path:
    cls, overrides, _ = ARCHS[arch]
    config = getattr(transformers, cls)(**{**_COMMON, **overrides, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)       # norms not all ones / zeros
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf_archs")


def _case(root: Path, arch: str, qname: str, qtype=None, **extra) -> tuple[Path, Path, Path]:
    """(HF folder, GGUF path, HF folder of the GGUF's dequantized weights), built once per case."""
    base = root / f"{arch}{'_' + '_'.join(map(str, extra.values())) if extra else ''}"
    folder = base / "hf"
    if not (folder / "config.json").exists():
        build_checkpoint(arch, folder, **extra)
    path = base / f"{qname}.gguf"
    rt = base / f"{qname}_rt"
    if not path.exists():
        rt_written = write_gguf(folder, path, arch, qtype or QTYPES[qname], ARCHS[arch][2])
        rt_written.rename(rt)
    return folder, path, rt


def _logits(model, prompts, steps: int = 3) -> torch.Tensor:
    sel = run_logits(model, Policy(gpu_batch_size=4, num_gpu_batches=1), prompts, [steps] * len(prompts))
    return torch.stack([torch.stack(sel.logits[r]) for r in range(len(prompts))])   # [rows, steps, v]


def _compare(root: Path, arch: str, qname: str, qtype=None, **extra) -> None:
    folder, path, rt = _case(root, arch, qname, qtype, **extra)
    cache = root / "model_cache"
    g = load_model(path, dtype=torch.float32, cache_dir=cache)
    same = load_model(rt, dtype=torch.float32)
    assert g.config.architecture == same.config.architecture
    prompts = make_prompts(2, VOCAB, seed=5, lo=10, hi=24)         # longer than the windows (8)
    mine, ref = _logits(g, prompts), _logits(same, prompts)
    err = (mine - ref).abs().max().item()
    assert err < 1e-4, f"{arch} {qname}: GGUF vs HF folder of the same weights: max |diff| {err}"
    if qname == "Q4_0":
        return                                    # its error is Q4_K's (both 4-bit); checked there
    orig = _logits(load_model(folder, dtype=torch.float32), prompts)
    rel = ((mine[:, 0] - orig[:, 0]).norm() / orig[:, 0].norm()).item()   # prefill logits
    assert rel < LOOSE[qname], f"{arch} {qname}: relative error {rel} against the unquantized checkpoint"


@pytest.mark.parametrize("qname", list(QTYPES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_matches_hf_folder_of_the_same_weights(root, arch, qname):
    _compare(root, arch, qname)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_q4_k_gguf_matches_hf_folder(root, arch):
    """Q4_K: 256-value super-blocks, so rows of 256 (hidden 256, intermediate 256; head_dim 64)."""
    extra = dict(hidden_size=256, intermediate_size=256, head_dim=64)
    if arch == "gemma3":
        extra["query_pre_attn_scalar"] = 64       # GGUF keeps no scalar: llama.cpp scales by head_dim
    _compare(root, arch, "Q4_K", Q.Q4_K, **extra)


def test_config_from_metadata(root):
    cache = root / "model_cache"
    c = {arch: load_model(_case(root, arch, "Q8_0")[1], cache_dir=cache).config for arch in ARCHS}
    assert c["llama"].rope_scaling["rope_type"] == "freq_factors" and len(c["llama"].rope_scaling["freq_factors"]) == 8
    assert c["qwen2"].attention_bias and c["qwen2"].tie_word_embeddings
    q2 = c["qwen2moe"]
    assert (q2.num_local_experts, q2.num_experts_per_tok, q2.moe_intermediate_size) == (4, 2, 32)
    assert q2.shared_expert_intermediate_size == 64 and not q2.norm_topk_prob and q2.mlp_only_layers == ()
    assert c["qwen3moe"].norm_topk_prob and c["qwen3"].head_dim == 32
    assert [c["gemma2"].layer_window(i) for i in range(3)] == [8, None, 8]
    assert c["gemma2"].attn_logit_softcapping == 50.0 and c["gemma2"].final_logit_softcapping == 30.0
    assert [c["gemma3"].layer_window(i) for i in range(6)] == [8] * 5 + [None]
    assert c["gemma3"].rope_local_base_freq == 1e4 and c["gemma3"].rope_scaling["rope_type"] == "linear"
    assert c["phi3"].rope_scaling["rope_type"] == "longrope"
    ds = c["deepseek2"]
    assert ds.architecture == "DeepseekV2ForCausalLM" and ds.is_mla and ds.head_dim == 24 and ds.v_head_dim == 16
    assert (ds.q_lora_rank, ds.kv_lora_rank, ds.qk_rope_head_dim, ds.first_k_dense_replace) == (48, 32, 8, 1)
    assert (ds.num_local_experts, ds.n_shared_experts, ds.routed_scaling_factor) == (4, 1, 1.5)
    assert ds.rope_scaling["rope_type"] == "yarn" and ds.rope_scaling["mscale_all_dim"] == pytest.approx(0.707)


def test_compressed_weights_take_the_source_grid(root):
    """compress_weights re-quantizes a GGUF's projections in groups of 32 (its blocks' width: a Q4_0 block's
    values land on the grid exactly) and a float checkpoint's in groups of 64; the memory model counts the
    same bytes as the executor holds."""
    folder, path, _ = _case(root, "llama", "Q4_0")
    policy = Policy(gpu_batch_size=1, compress_weights=True)
    for loaded, group in ((load_model(path, dtype=torch.float32, cache_dir=root / "model_cache"), 32),
                          (load_model(folder, dtype=torch.float32), 64)):
        assert loaded.config.weight_group_size == group
        ex = Executor(loaded, policy, device=torch.device("cpu"), dtype=torch.float32)
        try:
            packed = [h.value for homes in ex.weights.homes for h in homes.values() if isinstance(h.value, QTensor)]
            assert packed and {q.config.group_size for q in packed} == {group}
            held = sum(h.nbytes for homes in ex.weights.homes for h in homes.values())
            assert held == model_layout(loaded.config, 4, True).total_bytes
        finally:
            ex.close()


@pytest.mark.parametrize("arch, text, pieces", [
    ("qwen3", "hello world", ["hello", "Ġwor", "l", "d"]),
    ("gemma2", "hello world", None),
])
def test_tokenizer_and_chat_template_from_metadata(root, arch, text, pieces):
    from tokenizers import Tokenizer

    m = load_model(_case(root, arch, "Q8_0")[1], cache_dir=root / "model_cache")
    tok = Tokenizer.from_file(str(m.tokenizer_dir / "tokenizer.json"))
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc.ids) == text
    if pieces is not None:                        # BPE merges from tokenizer.ggml.merges are applied
        assert enc.tokens == pieces
    else:                                         # SentencePiece pieces, merged in the vocabulary's order
        assert "▁wor" in enc.tokens and "ll" in enc.tokens
    cfg = json.loads((m.tokenizer_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in cfg["chat_template"]


@pytest.mark.parametrize("arch, extra, message", [
    ("mamba", {}, "GGUF architecture 'mamba' is not supported; supported: .*'qwen3moe'"),
    ("llama", {"llama.expert_count": 8}, "Mixtral"),
    ("deepseek2", {"deepseek2.rope.dimension_count": 8, "deepseek2.attention.kv_lora_rank": 32,
                   "blk.0.attn_k_b.weight": None}, "attn_k_b / attn_v_b"),
])
def test_unsupported_gguf_is_refused_by_name(tmp_path, arch, extra, message):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(2)
    for key, value in extra.items():
        if value is None:
            w.add_tensor(key, torch.zeros(2, 2).numpy())               # a tensor, not a key
        else:
            w.add_uint32(key, value)
    w.add_tensor("token_embd.weight", torch.zeros(8, 32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path / "m.gguf", cache_dir=tmp_path / "cache")
