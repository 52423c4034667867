"""benchmarks/policy/prediction_errors.py: committed records re-predicted by today's cost model."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: `benchmarks.*`
from benchmarks.policy import prediction_errors  # noqa: E402

RECORD = {"system": "llmops", "ok": True, "model": "opt-30b", "config_name": "custom:56x1", "run_id": "r",
          "commit": {"sha": "abc1234"}, "prompt_len": 512, "gen_len": 32, "num_prompts": 56, "prefill_s": 3.6,
          "decode_step_s": 0.377, "total_s": 15.3, "num_gpus": 1,
          "policy": {"gpu_batch_size": 56, "num_gpu_batches": 1, "w_gpu": 0.0, "w_cpu": 1.0,
                     "compress_weights": True, "compress_cache": True}}


def test_only_finished_whole_model_runs_of_ours_count_once():
    cut = {**RECORD, "num_layers": 8}
    failed = {**RECORD, "ok": False}
    peer = {**RECORD, "system": "flexgen"}
    two_gpus = {**RECORD, "num_gpus": 2}
    assert prediction_errors.full_size_runs([RECORD, dict(RECORD), cut, failed, peer, two_gpus]) == [RECORD]


def test_a_record_sits_beside_its_prediction():
    row = prediction_errors.compare(RECORD, prediction_errors.reference_profile("h200"))
    assert row["step_ratio"] == pytest.approx(0.377 / row["predicted_step_s"])
    assert row["prefill_ratio"] == pytest.approx(3.6 / row["predicted_prefill_s"])
    # the prediction is the maximum of its decode channels (overlap on), per step
    assert max(row["decode_channels_s"].values()) == pytest.approx(row["predicted_step_s"])
    assert row["decode_bottleneck"] == "cpu->gpu"
    assert 0 < row["roofline_fraction_now"] < 1                   # the cache is on the GPU: weights bound it


def test_the_script_reads_files(tmp_path, capsys):
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps(RECORD) + "\n")
    rows = prediction_errors.main([str(f), "--json"])
    assert len(rows) == 1 and json.loads(capsys.readouterr().out)["config_name"] == "custom:56x1"
