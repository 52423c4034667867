"""benchmarks/throughput/throughput.py on the CPU with tiny presets: records carry the common fields, the roofline, and
(with --profile) the per-layer profile; absent peers skip with a reason."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: `benchmarks.*`
from benchmarks.throughput import throughput  # noqa: E402

FIELDS = {"run_id", "system", "workload", "model", "prompt_len", "gen_len", "num_prompts", "gpu_memory_gib",
          "tokens_per_s", "rows_per_h", "roofline_fraction", "peak_device_gib", "device", "commit", "command"}


def test_flexgen_workload_smoke(tmp_path):
    out = tmp_path / "t.jsonl"
    records = throughput.main(["--workload", "flexgen", "--model", "tiny-opt", "--prompt-len", "12", "--gen-len", "3",
                               "--num-prompts", "6", "--gpu-memory", "none", "--profile", "--out", str(out),
                               "--system", "llmops", "--system", "llmops-no-pipeline", "--system", "flexgen",
                               "--policy", "auto", "--policy", '{"gpu_batch_size": 2, "num_gpu_batches": 3}'])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(records) == 5 and len({r["run_id"] for r in lines}) == 1
    ours = [r for r in lines if r["system"].startswith("llmops")]
    for r in ours:
        assert FIELDS <= set(r) and r["ok"] and r["tokens_per_s"] > 0
        assert r["generated_tokens"] == 6 * 3 and r["num_prompts"] == 6
        assert 0 < r["roofline_fraction"] <= 1.0 and r["roofline"]["floor_s"] > 0
        parts = r["init_breakdown_s"]
        assert set(parts) == {"read", "quantize", "homes"} and min(parts.values()) >= 0
        assert parts["read"] > 0 and sum(parts.values()) <= r["init_s"] + 3e-3
        kinds = [row["kind"] for row in r["profile"]["decode"]["layers"]]
        assert kinds[0] == "embed" and kinds[-1] == "head" and len(kinds) == 2 + 2 * 2
    assert {r["policy"]["overlap"] for r in ours if r["system"] == "llmops-no-pipeline"} == {False}
    peer = next(r for r in lines if r["system"] == "flexgen")
    assert not peer["ok"] and peer["skipped"]


def test_wrangle_workload_reports_rows_per_hour(tmp_path):
    out = tmp_path / "w.jsonl"
    (rec,) = throughput.main(["--workload", "wrangle", "--model", "tiny-llama", "--prompt-len", "24",
                              "--prefix-len", "16", "--gen-len", "2", "--rows", "10", "--gpu-memory", "none",
                              "--policy", '{"gpu_batch_size": 4, "num_gpu_batches": 1}', "--out", str(out)])
    assert rec["ok"] and rec["blocks"] == 3 and rec["prefix_len"] == 16
    assert rec["rows_per_h"] == pytest.approx(10 * 3600 / rec["total_s"], rel=1e-3)
    assert rec["rows_1m_h"] == pytest.approx(1e6 / rec["rows_per_h"])
    assert rec["block_rows"] == [4, 4, 2] and len(rec["block_s"]) == 3
    assert sum(rec["block_s"]) == pytest.approx(rec["total_s"], rel=0.05)
    assert rec["rows_per_h_steady"] == pytest.approx(4 * 3600 / rec["block_s"][1], rel=1e-3)


def test_auto_plans_for_the_plan_rows_job(tmp_path, monkeypatch):
    seen = []
    real = throughput.choose_policy_estimate

    def spy(config, *, workload, **kw):
        seen.append(workload.num_prompts)
        return real(config, workload=workload, **kw)
    monkeypatch.setattr(throughput, "choose_policy_estimate", spy)
    (rec,) = throughput.main(["--workload", "wrangle", "--model", "tiny-llama", "--prompt-len", "24",
                              "--prefix-len", "16", "--gen-len", "2", "--rows", "6", "--plan-rows", "1000000",
                              "--gpu-memory", "none", "--policy", "auto", "--out", str(tmp_path / "w.jsonl")])
    assert seen == [1_000_000] and rec["plan_rows"] == 1_000_000 and rec["num_prompts"] == 6 and rec["ok"]


@pytest.mark.parametrize("policy, parallel", [
    ('{"gpu_batch_size": 2, "num_gpu_batches": 2, "w_gpu": 0.0, "w_cpu": 1.0}', "pipeline"),
    ('{"gpu_batch_size": 2, "num_gpu_batches": 1}', "data"),
])
def test_gpus_records_side_by_side(tmp_path, policy, parallel):
    """--gpus 1 --gpus 2 (two CPU devices here): same rows, same tokens, num_gpus on every record."""
    out = tmp_path / "g.jsonl"
    one, two = throughput.main(["--workload", "flexgen", "--model", "tiny-opt", "--prompt-len", "10", "--gen-len", "3",
                                "--gpu-memory", "none", "--policy", policy, "--gpus", "1", "--gpus", "2",
                                "--out", str(out)])
    assert [json.loads(line)["num_gpus"] for line in out.read_text().splitlines()] == [1, 2]
    assert one["ok"] and two["ok"] and one["num_prompts"] == two["num_prompts"] == 2 * one["policy"]["gpu_batch_size"] \
        * one["policy"]["num_gpu_batches"]
    assert two["parallel"] == parallel and two["devices"] == ["cpu", "cpu"]
    assert two["generated_tokens"] == one["generated_tokens"] == one["num_prompts"] * 3
    assert two["tokens_match_1gpu"] is True and two["tokens_digest"] == one["tokens_digest"]
    assert two["speedup_vs_1gpu"] > 0 and two["roofline"]["floor_s"] == pytest.approx(one["roofline"]["floor_s"] / 2)


def test_moe_workload_runs_ours_and_the_ablation(tmp_path):
    """Workload `moe` on tiny Mixtral: `llmops` pipelined, `llmops-no-pipeline` the same policy with
    `pipeline` and `overlap` off; the accelerate peer's record says why it skipped or what it ran."""
    out = tmp_path / "m.jsonl"
    policy = {"gpu_batch_size": 3, "num_gpu_batches": 2, "w_gpu": 0.0, "w_cpu": 0.5, "cache_gpu": 0.0,
              "cache_cpu": 1.0, "cpu_attention": True, "weight_pages": 4}
    records = throughput.main(["--workload", "moe", "--model", "tiny-mixtral", "--prompt-len", "10", "--gen-len", "3",
                               "--num-prompts", "6", "--gpu-memory", "none", "--out", str(out),
                               "--system", "llmops", "--system", "llmops-no-pipeline", "--system", "accelerate",
                               "--peer-rows", "4", "--peer-gen-len", "2", "--policy", json.dumps(policy)])
    assert len(records) == 3 and len({r["run_id"] for r in records}) == 1
    ours, ablation, peer = records
    for r in (ours, ablation):
        assert FIELDS <= set(r) and r["ok"] and r["workload"] == "moe" and r["generated_tokens"] == 6 * 3
        assert r["policy"]["cpu_attention"] and r["policy"]["weight_pages"] == 4
        assert r["tokens_digest"] == ours["tokens_digest"]
    assert ours["policy"]["pipeline"] and not ablation["policy"]["pipeline"]
    assert ours["policy"]["overlap"] and not ablation["policy"]["overlap"]
    assert peer["system"] == "accelerate" and peer["num_prompts"] == 4 and peer["config_name"] == "b4-gen2"
    assert peer["gen_len"] == 2 and peer["workload_gen_len"] == 3
    assert "not the workload's 3" in peer["peer_gen_len_note"]
    assert peer.get("skipped") or peer["projected_tokens_per_s_at_workload_gen"] > 0


def test_run_id_from_the_environment_joins_invocations(tmp_path, monkeypatch):
    """$LLMOPS_RUN_ID: two invocations of one suite run (an A/B of two commits) share their run_id."""
    monkeypatch.setenv("LLMOPS_RUN_ID", "suite-7")
    args = ["--workload", "wrangle", "--model", "tiny-llama", "--prompt-len", "24", "--prefix-len", "16",
            "--gen-len", "2", "--rows", "4", "--gpu-memory", "none", "--no-warmup",
            "--policy", '{"gpu_batch_size": 4, "num_gpu_batches": 1}']
    out = tmp_path / "ab.jsonl"
    (one,) = throughput.main(args + ["--out", str(out), "--commit", "aaaaaaa"])
    (two,) = throughput.main(args + ["--out", str(out), "--commit", "bbbbbbb"])
    assert one["run_id"] == two["run_id"] == "suite-7"
    lines = [json.loads(line) for line in out.read_text().splitlines()]            # one file, both commits kept
    assert [r["commit"]["sha"] for r in lines] == ["aaaaaaa", "bbbbbbb"]
    assert one["ok"] and len(one["step_s"]) == 1 and len(one["step_s"][0]) == 2   # the prefill, one decode step
    shape = list(args)                                                              # another shape of the run
    shape[shape.index("--gen-len") + 1] = "3"
    (three,) = throughput.main(shape + ["--out", str(out), "--commit", "aaaaaaa"])
    (again,) = throughput.main(shape + ["--out", str(out), "--commit", "aaaaaaa"])   # a rerun replaces its record
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["commit"]["sha"], r["gen_len"]) for r in lines] == [("aaaaaaa", 2), ("bbbbbbb", 2), ("aaaaaaa", 3)]
    assert lines[-1]["total_s"] == again["total_s"] != three["total_s"]


TINY_CUT = ["--workload", "flexgen", "--model", "tiny-opt", "--prompt-len", "8", "--gen-len", "4", "--num-prompts", "6",
            "--gpu-memory", "none", "--policy", '{"gpu_batch_size": 1, "num_gpu_batches": 1}',
            "--policy", '{"gpu_batch_size": 2, "num_gpu_batches": 1}']


def test_a_cut_configuration_is_recorded_and_the_harness_stops(tmp_path, monkeypatch):
    """SIGTERM's exception in the second measured block: that configuration's record says cut, where, and holds
    the first block's steps; the second --policy never runs."""
    calls = []

    class CutOnThird(throughput.Executor):
        def _run_block(self, *a, **kw):
            calls.append(len(a[0]))
            if len(calls) == 3:                  # warm-up, block 1, then block 2 is cut
                raise throughput.Cut("terminated by signal 15 during: block 2/6")
            return super()._run_block(*a, **kw)
    monkeypatch.setattr(throughput, "Executor", CutOnThird)
    out = tmp_path / "cut.jsonl"
    with pytest.raises(SystemExit) as stop:
        throughput.main([*TINY_CUT, "--out", str(out)])
    assert stop.value.code == 124 and len(calls) == 3
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["ok"] is False and rec["cut"] is True and "block 2/6" in rec["error"]
    assert rec["config_name"] == "custom:1x1" and [len(s) for s in rec["step_s"]] == [4]   # prefill + 3 steps


def test_sigterm_during_a_run_writes_the_cut_record(tmp_path):
    """The real signal, as `timeout` sends it, once the harness says the measured blocks began."""
    out = tmp_path / "term.jsonl"
    env = dict(os.environ)
    args = ["--workload", "flexgen", "--model", "tiny-opt", "--prompt-len", "8", "--gen-len", "64", "--num-prompts",
            "400", "--gpu-memory", "none", "--policy", '{"gpu_batch_size": 1, "num_gpu_batches": 1}', "--out", str(out)]
    proc = subprocess.Popen([sys.executable, str(Path(throughput.__file__)), *args], env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in proc.stderr:
        if "block 2/400" in line:
            proc.terminate()
            break
    proc.stderr.read()
    assert proc.wait(timeout=120) == 124
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["cut"] is True and "block" in rec["error"] and rec["step_s"] and len(rec["step_s"][0]) == 64
