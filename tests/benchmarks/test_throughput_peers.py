"""benchmarks/throughput/throughput_peers.py on the CPU: the Accelerate peer's dummy model (built without transformers'
init, filled as the engine's dummy weights are), its per-step timing and its short-run projection."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: `benchmarks.*`
from benchmarks.throughput import throughput_peers as peers  # noqa: E402

from engine.models.dummy_source import BLOCK  # noqa: E402
from engine.models.presets import PRESETS  # noqa: E402

transformers = pytest.importorskip("transformers")


def test_fill_dummy_tiles_a_seeded_block():
    a, b, c = (torch.empty(2, BLOCK + 3) for _ in range(3))
    peers.fill_dummy_("layers.0.q_proj.weight", a)
    peers.fill_dummy_("layers.0.q_proj.weight", b)
    peers.fill_dummy_("layers.0.k_proj.weight", c)
    flat = a.view(-1)
    assert torch.equal(a, b) and not torch.equal(a, c)                       # seeded by the name
    assert torch.equal(flat[BLOCK:2 * BLOCK], flat[:BLOCK]) and torch.equal(flat[2 * BLOCK:], flat[:6])
    assert 0.015 < flat[:BLOCK].std().item() < 0.025
    bias, norm = torch.empty(5), torch.empty(5)
    peers.fill_dummy_("fc1.bias", bias)
    peers.fill_dummy_("final_layer_norm.weight", norm)
    assert bias.eq(0).all() and norm.eq(1).all()


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-opt"])
def test_dummy_hf_model_is_filled_and_runs(preset):
    lm = peers.dummy_hf_model(PRESETS[preset], torch.float32)
    for name, p in lm.named_parameters():
        if name.endswith("bias"):
            assert p.eq(0).all(), name
        elif p.dim() == 1:
            assert p.eq(1).all(), name                                      # norm weights
        else:
            assert p.abs().max() > 0 and p.abs().max() < 0.2, name
    reference = transformers.AutoModelForCausalLM.from_config(peers.hf_model_config(PRESETS[preset]))
    ref_buffers = dict(reference.named_buffers())
    for name, buf in lm.named_buffers():                                    # computed, not left uninitialised
        assert torch.equal(buf, ref_buffers[name]), name
    assert (lm.lm_head.weight is lm.get_input_embeddings().weight) == reference.config.tie_word_embeddings
    ids = torch.randint(10, 300, (2, 9))
    with torch.no_grad():
        logits = lm(ids).logits                                             # [2, 9, vocab]
    assert logits.shape == (2, 9, PRESETS[preset]["vocab_size"]) and torch.isfinite(logits).all()
    assert logits.std() > 0


def test_dummy_hf_model_keeps_the_dtype():
    lm = peers.dummy_hf_model(PRESETS["tiny-mixtral"], torch.float16)
    assert {p.dtype for p in lm.parameters()} == {torch.float16}
    assert all(torch.isfinite(p).all() for p in lm.parameters())


def test_timed_generate_marks_every_step():
    lm = peers.dummy_hf_model(PRESETS["tiny-mixtral"], torch.float32)
    ids = torch.randint(10, 300, (3, 6))
    res = peers.timed_generate(lm, ids, 4)
    (steps,) = res["step_s"]
    assert len(steps) == 4 and all(s > 0 for s in steps)                    # the prefill, then 3 decode steps
    assert 0 < res["prefill_s"] and 0 < res["decode_s"] <= res["total_s"] - res["prefill_s"] + 1e-3
    assert res["decode_s"] == pytest.approx(sum(steps[1:]), abs=1e-3)


@pytest.mark.parametrize("res, gen, expected", [
    ({"ok": True, "prefill_s": 16.0, "decode_s": 48.0}, 4, 256 * 128 / (16.0 + 127 * 16.0)),
    ({"ok": True, "prefill_s": 16.0, "decode_s": 0.0}, 1, None),            # no decode step to project from
    ({"ok": False, "skipped": "accelerate needs a CUDA device"}, 4, None),
])
def test_short_run_fields_project_to_the_workload(res, gen, expected):
    out = peers.short_run_fields(res, 256, gen, 128)
    assert out["gen_len"] == gen and out["workload_gen_len"] == 128 and "128" in out["peer_gen_len_note"]
    assert out["projected_tokens_per_s_at_workload_gen"] == (None if expected is None else pytest.approx(expected))


def test_short_run_fields_no_note_at_the_workload_gen():
    out = peers.short_run_fields({"ok": True, "prefill_s": 2.0, "decode_s": 3.0}, 8, 4, 4)
    assert "peer_gen_len_note" not in out
    assert out["projected_tokens_per_s_at_workload_gen"] == pytest.approx(8 * 4 / 5.0)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("accelerate") is None,
                    reason="run_accelerate needs accelerate and a CUDA device")
def test_run_accelerate_on_tiny_mixtral():
    prompts = [[11 + i, 12, 13, 14, 15] for i in range(3)]
    res = peers.run_accelerate("tiny-mixtral", prompts, 3, 1 << 30, 4, PRESETS["tiny-mixtral"])
    assert res["ok"] and res["num_prompts"] == 4 and res["generated_tokens"] == 12
    assert len(res["step_s"][0]) == 3 and res["load_s"] > 0 and res["place_s"] > 0
