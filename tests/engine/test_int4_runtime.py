"""AWQ / GPTQ int4 checkpoints run in their packed form: the executor's weight homes hold the checkpoint's
QTensors (its group size, its codes bit for bit, on gpu/cpu/disk, with or without compress_weights), greedy
tokens under the offloading matrix equal the in-memory run, logits equal a float checkpoint of the
dequantized weights, and the memory model counts what the executor reserves.

Checkpoints are packed in the test as AutoAWQ / AutoGPTQ lay them out (helpers/int4_pack.py), in
groups other than WEIGHT_QUANT's 64 (32, 16), so a re-quantization would show, and in one group per input row
(as wide as WEIGHT_QUANT's groups where a row has 64 inputs: there the codes compared bit for bit tell).
(GPTQ's original "gptq" format stores z - 1 in 4 bits, so a zero point of 0 reads back as 16, as in AutoGPTQ's
kernels: with groups of 16 the test's random weights hit that, hence groups of 32 for that format here.)
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.calibrate.machine import default_cpu_profile
from engine.models.cpu_linear import Int4Linear
from engine.models.loader import load_model
from engine.policy.cost_model import estimate
from engine.policy.memory import executor_memory
from engine.policy.policy import Policy
from engine.quant.config import WEIGHT_QUANT
from engine.quant.qtensor import QTensor
from engine.runtime.executor import Executor
from engine.runtime.layout import model_layout
from engine.storage.tiers import Tier
from helpers.budget_checks import POLICIES, WORKLOAD
from helpers.greedy_runs import GreedyRecorder, RunToEnd, make_prompts, run_policy
from helpers.int4_pack import AWQ_QC, GPTQ_QC, write_int4
from helpers.offload_matrix import BASE, MATRIX
from helpers.skips import requires_cuda
from helpers.tiny_checkpoints import build_tiny_checkpoint

CASES = {   # name -> (float family, method, quantization_config, packer keywords, group of the packer)
    "llama-awq-g32": ("llama", "awq", {**AWQ_QC, "group_size": 32}, {}, 32),
    "llama-gptq-g32": ("llama", "gptq", {**GPTQ_QC, "group_size": 32}, {}, 32),
    "mixtral-gptq2-row": ("mixtral", "gptq", {**GPTQ_QC, "group_size": -1, "checkpoint_format": "gptq_v2"},
                          {"zero_offset": 0}, None),
    "mixtral-awq-g16": ("mixtral", "awq", {**AWQ_QC, "group_size": 16}, {}, 16),
}
MAX_NEW = [6, 9, 3, 9, 7, 9, 5, 9, 8]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Every CASES checkpoint (and its `_float` twin of the dequantized weights) in one module folder."""
    root = tmp_path_factory.mktemp("int4run")
    floats = {}
    out = {}
    for name, (kind, method, qc, kw, group) in CASES.items():
        if kind not in floats:
            floats[kind] = root / f"src-{kind}"
            build_tiny_checkpoint(kind, floats[kind])
        write_int4(floats[kind], root / name, method, qc, group, **kw)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def reference(models):
    """Per case: (loaded, prompts, tokens of the all-in-memory policy)."""
    out = {}
    for name, path in models.items():
        loaded = load_model(path, dtype=torch.float32)
        prompts = make_prompts(9, loaded.config.vocab_size, seed=3)
        tokens, _ = run_policy(loaded, Policy(**BASE), prompts, MAX_NEW)
        out[name] = (loaded, prompts, tokens)
    return out


def _check_homes(ex: Executor, loaded, in_groups: int | None) -> int:
    """Every decoder matmul weight's home is the source's QTensor (groups of `in_groups` inputs, None: a
    whole row; the same bytes, compared on the host); the rest dense. Returns how many were checked."""
    checked = 0
    for spec, homes in zip(ex.specs, ex.weights.homes):
        want = loaded.weights.get_qtensors(spec)
        for name, ws in spec.weights.items():
            value = homes[name].value
            if not ws.quantizable:
                assert not isinstance(value, QTensor), f"{spec.name}.{name}"
                continue
            q = want[name]
            assert isinstance(value, QTensor) and value.config == q.config, f"{spec.name}.{name}"
            assert value.config.group_size == (in_groups or ws.shape[-1])
            assert in_groups is None or in_groups != WEIGHT_QUANT.group_size
            for got, ref in zip(value.parts(), q.parts()):
                assert torch.equal(got.cpu(), ref), f"{spec.name}.{name}"
            checked += 1
    return checked


def _checked_run(loaded, policy: Policy, device: str, prompts, in_groups: int | None,
                 tmp_path: Path) -> tuple[dict, set]:
    """Greedy tokens of one block under `policy`, after `_check_homes`, and the tiers the homes are on."""
    ex = Executor(loaded, policy, device=torch.device(device), dtype=torch.float32, disk_dir=tmp_path)
    try:
        assert _check_homes(ex, loaded, in_groups) >= 2 * loaded.config.num_hidden_layers
        tiers = {h.tier for homes in ex.weights.homes for h in homes.values()}
        sel = GreedyRecorder()
        ex.generate_block(prompts, MAX_NEW, sel)
        return sel.tokens, tiers
    finally:
        ex.close()


def _uniform_block(loaded, policy: Policy, device: str, tmp_path: Path, **budgets) -> tuple[int, dict]:
    """(bytes of the weight homes, the budget report) of one block of WORKLOAD-shaped rows."""
    ex = Executor(loaded, policy, device=torch.device(device), dtype=torch.float32, disk_dir=tmp_path, **budgets)
    try:
        held = sum(h.nbytes for homes in ex.weights.homes for h in homes.values())
        prompts = [[3 + (r + t) % 50 for t in range(WORKLOAD.prompt_len)] for r in range(policy.block_size)]
        ex.generate_block(prompts, [WORKLOAD.gen_len] * policy.block_size, RunToEnd())
        return held, ex.memory_report()
    finally:
        ex.close()


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("policy", [dict(w_gpu=0.2, w_cpu=0.3), dict(w_gpu=0.0, w_cpu=1.0, compress_weights=True),
                                    dict(w_gpu=0.0, w_cpu=0.0, compress_weights=True)],
                         ids=["w_disk", "w_cpu_compress", "w_all_disk_compress"])
def test_homes_hold_the_checkpoints_codes(reference, name, policy, tmp_path):
    loaded, prompts, tokens = reference[name]
    got, tiers = _checked_run(loaded, Policy(**{**BASE, **policy}), "cpu", prompts, CASES[name][4], tmp_path)
    assert Tier.CPU in tiers or Tier.DISK in tiers
    assert got == tokens


@pytest.mark.parametrize("policy", list(MATRIX))
def test_llama_awq_matrix_matches_in_memory(reference, policy, tmp_path):
    loaded, prompts, tokens = reference["llama-awq-g32"]
    got, _ = run_policy(loaded, Policy(**{**BASE, **MATRIX[policy]}), prompts, MAX_NEW, disk_dir=tmp_path)
    assert got == tokens


@pytest.mark.parametrize("policy", ["w_all_disk", "cache_cpu_attn", "no_overlap_all_off", "one_batch_all_off"])
@pytest.mark.parametrize("name", ["llama-gptq-g32", "mixtral-gptq2-row", "mixtral-awq-g16"])
def test_other_checkpoints_under_the_matrix(reference, name, policy, tmp_path):
    loaded, prompts, tokens = reference[name]
    got, _ = run_policy(loaded, Policy(**{**BASE, **MATRIX[policy]}), prompts, MAX_NEW, disk_dir=tmp_path)
    assert got == tokens


class LogitRecorder:
    """TokenSelector: argmax, recording every step's logits per row."""

    def __init__(self):
        self.logits: dict[int, list[torch.Tensor]] = {}

    def __call__(self, rows, logits):
        for r, row in zip(rows, logits):
            self.logits.setdefault(r, []).append(row.clone())
        return logits.argmax(-1).tolist(), [False] * len(rows)


def _logits(path: Path, policy: Policy, prompts, tmp_path: Path) -> dict[int, torch.Tensor]:
    loaded = load_model(path, dtype=torch.float32)
    ex = Executor(loaded, policy, device=torch.device("cpu"), dtype=torch.float32, disk_dir=tmp_path)
    try:
        sel = LogitRecorder()
        ex.generate_block(prompts, MAX_NEW, sel)
        return {r: torch.stack(v) for r, v in sel.logits.items()}
    finally:
        ex.close()


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_a_dense_model_of_the_dequantized_weights(models, reference, name, tmp_path):
    _, prompts, _ = reference[name]
    policy = Policy(**{**BASE, **MATRIX["no_overlap_all_off"]})
    packed = _logits(models[name], policy, prompts, tmp_path / "q")
    dense = _logits(models[name].parent / f"{name}_float", policy, prompts, tmp_path / "f")
    assert packed.keys() == dense.keys() and len(packed) == len(prompts)
    for r in packed:
        torch.testing.assert_close(packed[r], dense[r], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama-awq-g32", "mixtral-gptq2-row"])
@pytest.mark.parametrize("policy", POLICIES, ids=range(len(POLICIES)))
def test_memory_model_is_the_executors_accounting(reference, name, policy, tmp_path):
    """As `check_budget_consistency` (helpers/budget_checks.py) for presets: the cost model's memory,
    `executor_memory` and the executor's budget peaks agree, with the checkpoint's groups counted (with and
    without compress_weights)."""
    loaded, _, _ = reference[name]
    config = loaded.config
    layout = model_layout(config, 4, policy.compress_weights)
    counted = executor_memory(config, layout, policy, WORKLOAD.prompt_len, WORKLOAD.gen_len, 4, "cpu")
    predicted = estimate(config, policy, WORKLOAD, default_cpu_profile(), 4,
                         layout=model_layout(config)).peak_memory_bytes
    assert predicted["gpu"] >= counted["gpu"] and predicted["cpu"] == counted["cpu"]
    assert layout.total_bytes < model_layout(_float_config(config), 4, False).total_bytes / 2
    held, report = _uniform_block(loaded, policy, "cpu", tmp_path, gpu_memory=predicted["gpu"] + 1024,
                                  cpu_memory=predicted["cpu"] + 1024)
    assert held == layout.total_bytes
    assert report["gpu"]["peak"] == counted["gpu"] and report["cpu"]["peak"] == counted["cpu"]


def _float_config(config):
    return replace(config, quantization_config=None)


def test_modules_to_not_convert_stay_float_and_are_counted(models, tmp_path):
    """A checkpoint leaving o_proj in float (modules_to_not_convert): o_proj is dense without compress_weights,
    WEIGHT_QUANT's groups with it; the rest keep the checkpoint's; the memory model agrees; a file that packs
    a module the config says is left in float is refused naming the tensor."""
    src = models["llama-awq-g32"]
    dst = tmp_path / "skip"
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    floats = load_file(str(src.parent / "llama-awq-g32_float" / "model.safetensors"))
    for name in [n for n in tensors if ".o_proj." in n]:
        del tensors[name]
    tensors.update({n: w for n, w in floats.items() if ".o_proj." in n})
    save_file(tensors, str(dst / "model.safetensors"))
    d = json.loads((src / "config.json").read_text())
    d["quantization_config"] = {**d["quantization_config"], "modules_to_not_convert": ["o_proj"]}
    (dst / "config.json").write_text(json.dumps(d))
    loaded = load_model(dst, dtype=torch.float32)
    for compress, o_group in ((False, None), (True, WEIGHT_QUANT.group_size)):
        policy = Policy(gpu_batch_size=2, compress_weights=compress)
        ex = Executor(loaded, policy, device=torch.device("cpu"), dtype=torch.float32)
        try:
            attn = ex.weights.homes[1]
            o = attn["o_proj.weight"].value
            assert (o.config.group_size if isinstance(o, QTensor) else None) == o_group
            assert attn["qkv_proj.weight"].value.config.group_size == 32
            held = sum(h.nbytes for homes in ex.weights.homes for h in homes.values())
            assert held == model_layout(loaded.config, 4, compress).total_bytes
        finally:
            ex.close()
    (src.parent / "bad").mkdir()
    save_file(load_file(str(src / "model.safetensors")), str(src.parent / "bad" / "model.safetensors"))
    (src.parent / "bad" / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"o_proj\.weight' is packed.*modules_to_not_convert=\['o_proj'\]"):
        load_model(src.parent / "bad", dtype=torch.float32)


def test_half_dtypes_keep_the_codes_and_round_min_scale_once(models, reference):
    """A bfloat16 executor over an fp32-loaded checkpoint: the same codes, float16 min/scale (one rounding of
    the float32 ones), and the tokens of a bfloat16 load of the same files."""
    loaded32, prompts, _ = reference["llama-awq-g32"]
    ex = Executor(loaded32, Policy(gpu_batch_size=3, num_gpu_batches=3), device=torch.device("cpu"),
                  dtype=torch.bfloat16)
    try:
        spec, home = ex.specs[1], ex.weights.homes[1]["qkv_proj.weight"].value
        home = home.q if isinstance(home, Int4Linear) else home     # packed for the CPU's int4 kernel
        want = loaded32.weights.get_qtensors(spec)["qkv_proj.weight"]
        assert home.dtype == torch.bfloat16 and home.mn.dtype == home.scale.dtype == torch.float16
        assert torch.equal(home.data, want.data) and torch.equal(home.scale, want.scale.half())
        assert torch.equal(home.mn, want.mn.half())
        sel = GreedyRecorder()
        ex.generate_block(prompts, MAX_NEW, sel)
    finally:
        ex.close()
    tokens, _ = run_policy(load_model(models["llama-awq-g32"], dtype=torch.bfloat16),
                           Policy(gpu_batch_size=3, num_gpu_batches=3), prompts, MAX_NEW, dtype=torch.bfloat16)
    assert sel.tokens == tokens


@pytest.mark.parametrize("keys", [["gate"], ["o_proj"], ["mlp.gate"], ["model.layers.1"], ["model.layers.*.mlp"],
                                  ["lm_head", "model.layers.0.self_attn"]])
def test_modules_to_not_convert_match_as_transformers_does(keys):
    from transformers.quantizers.quantizers_utils import should_convert_module

    from engine.models.int4_config import Int4Config

    q = Int4Config.from_hf({**AWQ_QC, "modules_to_not_convert": keys})
    modules = [f"model.layers.{j}.{m}" for j in (0, 1, 11) for m in
               ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate", "mlp.gate_proj", "mlp.experts.0.w1")]
    got = {m: q.packs((f"{m}.weight",)) for m in modules}
    assert got == {m: should_convert_module(m, keys) for m in modules}
    assert not all(got.values()) and any(got.values())


@requires_cuda
@pytest.mark.parametrize("policy", ["w_half_cpu", "w_all_disk", "cache_cpu_attn", "one_batch_all_off"])
@pytest.mark.parametrize("name", ["llama-awq-g32", "mixtral-gptq2-row"])
def test_cuda_matrix_keeps_the_codes_and_matches_in_memory(reference, name, policy, tmp_path):
    """On CUDA (pinned homes, relay buffers for disk homes, the Triton dequant of the checkpoint's groups):
    homes hold the checkpoint's codes, tokens equal the CUDA in-memory run, and a block of uniform rows
    peaks at `executor_memory`'s bytes on both tiers."""
    loaded, prompts, _ = reference[name]
    tokens, _ = run_policy(loaded, Policy(**BASE), prompts, MAX_NEW, device="cuda")
    p = Policy(**{**BASE, **MATRIX[policy]})
    got, _ = _checked_run(loaded, p, "cuda", prompts, CASES[name][4], tmp_path)
    assert got == tokens
    counted = executor_memory(loaded.config, model_layout(loaded.config, 4, False), p, WORKLOAD.prompt_len,
                              WORKLOAD.gen_len, 4, "cuda")
    _, report = _uniform_block(loaded, p, "cuda", tmp_path)
    assert report["gpu"]["peak"] == counted["gpu"] and report["cpu"]["peak"] == counted["cpu"]


@pytest.mark.parametrize("name", ["llama-awq-g32", "llama-gptq-g32"])
@pytest.mark.parametrize("bytes_per_element", [2, 4])
def test_model_stats_count_the_checkpoints_groups(reference, name, bytes_per_element):
    """Where every input dim is a multiple of the group, model_stats' per-layer bytes (the planner's sizes)
    equal the executor's layout exactly, compress_weights or not."""
    from engine.policy import model_stats as ms

    config = reference[name][0].config
    for compress in (False, True):
        want = model_layout(config, bytes_per_element, compress).total_bytes
        got = (ms.layer_weight_bytes(config, bytes_per_element, compress) * config.num_hidden_layers
               + ms.edge_weight_bytes(config, bytes_per_element))
        assert got == want
    assert ms.layer_dense_bytes(config, 4) > 4 * ms.layer_weight_bytes(config, 4)
