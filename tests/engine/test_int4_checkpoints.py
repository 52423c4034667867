"""AWQ / GPTQ int4 checkpoints load into our 4-bit format: packed from a random float weight exactly as AutoAWQ
(`WQLinear_GEMM.from_linear`) and AutoGPTQ (`QuantLinear.pack`) lay them out (helpers/int4_pack.py), saved as
safetensors with a quantization_config, loaded through `load_model`: the QTensors dequantize to the reference
(q - z) * s bit for bit (fp32), and the logits equal transformers' on a float checkpoint of those weights.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.loader import load_model
from engine.policy.policy import Policy
from engine.quant.group import dequantize
from engine.quant.qtensor import QTensor
from helpers.greedy_runs import make_prompts, run_logits
from helpers.int4_pack import AWQ_QC, GPTQ_QC, GROUP, write_int4
from helpers.parity import check_against_hf
from helpers.tiny_checkpoints import build_tiny_checkpoint


@pytest.fixture(scope="module")
def floats(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int4src")
    return {kind: (build_tiny_checkpoint(kind, root / kind), root / kind)[1] for kind in ("llama", "mixtral")}


@pytest.mark.parametrize("kind, method, qc, kw", [
    ("llama", "awq", AWQ_QC, {}),
    ("llama", "gptq", GPTQ_QC, {}),
    ("mixtral", "gptq", {**GPTQ_QC, "checkpoint_format": "gptq_v2"}, {"zero_offset": 0}),
    ("mixtral", "awq", AWQ_QC, {}),
])
def test_int4_weights_and_logits(floats, tmp_path, kind, method, qc, kw):
    import transformers

    ref = write_int4(floats[kind], tmp_path / kind, method, qc, **kw)
    loaded = load_model(tmp_path / kind, dtype=torch.float32)
    checked = 0
    for spec in loaded.family.layer_specs():
        dense = loaded.weights.get(spec)
        packed = loaded.weights.get_qtensors(spec)
        for local, ws in spec.weights.items():
            if not all(s in ref for s in ws.sources):
                assert local not in packed
                continue
            q = packed[local]
            assert isinstance(q, QTensor) and q.config.group_size == GROUP and tuple(q.shape) == ws.shape
            parts = [ref[s] for s in ws.sources]
            want = torch.stack(parts) if len(ws.shape) == 3 else torch.cat(parts)
            assert torch.equal(dequantize(q), want) and torch.equal(dense[local], want), f"{spec.name}/{local}"
            checked += 1
    assert checked >= 4 * loaded.config.num_hidden_layers // 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{kind}_float").eval()
    prompts = make_prompts(8, loaded.config.vocab_size, seed=5, lo=2, hi=30)
    sel = run_logits(loaded, Policy(gpu_batch_size=4, num_gpu_batches=2), prompts, [5] * 8)
    check_against_hf(hf, prompts, sel)


@pytest.mark.parametrize("method, qc", [("gptq", GPTQ_QC), ("awq", AWQ_QC)])
def test_group_size_minus_one_is_one_group_per_row(floats, tmp_path, method, qc):
    ref = write_int4(floats["llama"], tmp_path / "g", method, {**qc, "group_size": -1}, group=None)
    loaded = load_model(tmp_path / "g", dtype=torch.float32)
    spec = loaded.family.layer_specs()[2]                                          # layer 0's MLP
    q = loaded.weights.get_qtensors(spec)["down_proj.weight"]
    assert q.config.group_size == 128 and torch.equal(dequantize(q), ref["model.layers.0.mlp.down_proj.weight"])


def test_a_group_size_that_does_not_match_the_tensors_names_them(floats, tmp_path):
    """Found from the headers at load, before any weight is read."""
    write_int4(floats["llama"], tmp_path / "w", "awq", {**AWQ_QC, "group_size": 16})
    with pytest.raises(ValueError, match=r"q_proj\.qzeros' is \[2, 8\], expected \[4, 8\].*groups of 16"):
        load_model(tmp_path / "w", dtype=torch.float32)


def test_act_order_g_idx_is_refused_naming_the_tensor(floats, tmp_path):
    """desc_act with g_idx still input // group_size loads; a permuted g_idx is refused at load."""
    write_int4(floats["llama"], tmp_path / "act", "gptq", {**GPTQ_QC, "desc_act": True})
    assert load_model(tmp_path / "act").config.num_hidden_layers == 2
    path = tmp_path / "act" / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.0.self_attn.q_proj.g_idx"
    tensors[name] = tensors[name][torch.randperm(tensors[name].numel(), generator=torch.Generator().manual_seed(0))]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=r"q_proj\.g_idx.*act-order"):
        load_model(tmp_path / "act", dtype=torch.float32)


@pytest.mark.parametrize("qc, match", [
    ({**AWQ_QC, "bits": 8}, "bits=8 is not supported"),
    ({**AWQ_QC, "version": "gemv"}, "version='gemv' is not supported"),
    ({**AWQ_QC, "zero_point": False}, "zero_point=false"),
    ({**GPTQ_QC, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "pre-quantized checkpoint.*'bitsandbytes'"),
    ({"quant_method": "fp8", "fmt": "e4m3"}, "pre-quantized checkpoint.*'fp8'"),
])
def test_unsupported_settings_are_named(floats, tmp_path, qc, match):
    dst = tmp_path / "bad"
    shutil.copytree(floats["llama"], dst)
    d = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**d, "quantization_config": qc}))
    with pytest.raises(ValueError, match=match):
        load_model(dst)


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("in_f, group", [(256, 64), (256, 256), (96, 32), (200, 64)])
def test_packed_bytes_path_equals_the_per_code_path(method, in_f, group):
    """Whole even groups take the byte path (AWQ: the nibbles of two rows in one int32 op; GPTQ: its int32s
    transposed are our bytes); it gives the per-code path's QTensor bit for bit, on every nibble value and
    sign bit (a ragged last group, 200 inputs in groups of 64, takes the per-code path)."""
    from engine.quant import int4_checkpoint as ic

    g = torch.Generator().manual_seed(in_f + group)
    out_f, groups = 48, -(-in_f // group)
    words = (in_f, out_f // 8) if method == "awq" else (in_f // 8, out_f)
    qweight = torch.randint(-2**31, 2**31 - 1, words, dtype=torch.int32, generator=g)
    qzeros = torch.randint(-2**31, 2**31 - 1, (groups, out_f // 8), dtype=torch.int32, generator=g)
    scales = torch.rand((groups, out_f), generator=g).to(torch.float16)
    if method == "awq":
        got = ic.awq_qtensor(qweight, qzeros, scales, group, torch.bfloat16)
        codes = ic.unpack_nibbles(qweight, 1, ic.AWQ_ORDER).t().contiguous()
        zeros = ic.unpack_nibbles(qzeros, 1, ic.AWQ_ORDER).t()
    else:
        got = ic.gptq_qtensor(qweight, qzeros, scales, None, group, torch.bfloat16, zero_offset=1)
        codes = ic.unpack_nibbles(qweight, 0).t().contiguous()
        zeros = ic.unpack_nibbles(qzeros, 1).t().to(torch.int16) + 1
    want = ic.pack_qtensor(codes, zeros, scales.t(), group, torch.bfloat16)
    assert ic._whole_bytes(in_f, group) == (in_f % group == 0)
    for name in ("data", "mn", "scale"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.shape == want.shape == torch.Size((out_f, in_f))
