"""`llmops policy` / `llmops profile` through click's CliRunner, and the shared size parser. Every test plans
into a plan cache of its own (`LLMOPS_CACHE_DIR`)."""
import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from engine.calibrate.machine import default_cpu_profile
from engine.calibrate.profile_cache import save_profile
from engine.policy.hardware import reference_profile
from engine.util.sizes import format_size, parse_size
from llmops.cli_policy import policy_cmd, profile_cmd


@pytest.mark.parametrize("text, expected", [
    ("16GiB", 16 * 1024**3), ("500GB", 500 * 10**9), ("1.5 TiB", int(1.5 * 1024**4)), ("4096", 4096),
    (4096, 4096), ("64mib", 64 * 1024**2), ("0", 0), ("2k", 2000),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["16 GiBs", "lots", "-1GB", "", "1..2GB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_format_size():
    assert format_size(16 * 1024**3) == "16.00 GiB"


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPS_CACHE_DIR", str(tmp_path / "llmops-cache"))


BASE = ["--model", "opt-30b", "--gpu-memory", "16GiB", "--cpu-memory", "100GiB", "--disk-memory", "500GiB",
        "--prompt-len", "512", "--gen-len", "32", "--hardware", "h200"]


def test_policy_json_keys():
    result = CliRunner().invoke(policy_cmd, BASE + ["--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert {"policy", "predicted_tokens_per_s", "predicted_prefill_s", "predicted_decode_s", "predicted_peak_bytes",
            "budgets_bytes", "workload", "source", "chosen_by"} <= set(data)
    assert set(data["predicted_peak_bytes"]) == {"gpu", "cpu", "disk"}
    assert data["predicted_peak_bytes"]["gpu"] <= 16 * 1024**3 == data["budgets_bytes"]["gpu"]
    assert data["chosen_by"] == "cost model" and data["workload"]["prompt_len"] == 512
    assert {"gpu_batch_size", "num_gpu_batches", "w_gpu", "cache_cpu", "cpu_attention"} <= set(data["policy"])
    assert "h200" in data["profile"]


def test_policy_shared_prefix_len_shortens_the_prefill_and_is_checked():
    wrangle = ["--model", "llama-3-70b", "--gpu-memory", "16GiB", "--cpu-memory", "100GiB", "--compress-weights",
               "--compress-cache", "--prompt-len", "200", "--gen-len", "10", "--num-prompts", "1536",
               "--hardware", "h200", "--json"]
    plain = json.loads(CliRunner().invoke(policy_cmd, wrangle).output)
    result = CliRunner().invoke(policy_cmd, wrangle + ["--shared-prefix-len", "150"])
    assert result.exit_code == 0, result.output
    shared = json.loads(result.output)
    # planned in the run's bucket: the prefix rounded down to 16 tokens, the prompt count as it is
    assert shared["workload"]["shared_prefix_len"] == 144 and plain["workload"]["shared_prefix_len"] == 0
    # either plan may run its prefills ahead (`predicted_prefill_s` is then its 1 / blocks in series): compare
    # whole prefills

    def whole_prefill(plan):
        p, rows = plan["policy"], plan["workload"]["num_prompts"]
        return plan["predicted_prefill_s"] * (-(-rows // (p["gpu_batch_size"] * p["num_gpu_batches"]))
                                              if p["prefill_ahead"] else 1)
    assert whole_prefill(shared) < whole_prefill(plain) / 2
    text = CliRunner().invoke(policy_cmd, wrangle[:-1] + ["--shared-prefix-len", "150"]).output
    assert "prompt 200 tokens (144 shared)" in text
    bad = CliRunner().invoke(policy_cmd, wrangle + ["--shared-prefix-len", "200"])
    assert bad.exit_code == 2 and "--shared-prefix-len" in bad.output and "below --prompt-len 200" in bad.output


def test_policy_text_names_the_profile():
    result = CliRunner().invoke(policy_cmd, BASE)
    assert result.exit_code == 0, result.output
    assert "built-in reference h200" in result.output and "tokens/s" in result.output


def test_policy_from_profile_file(tmp_path):
    path = tmp_path / "hw.json"
    save_profile(reference_profile("h200"), path)
    result = CliRunner().invoke(policy_cmd, ["--model", "opt-6.7b", "--profile", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert str(path) in json.loads(result.output)["profile"]


def test_no_fit_exits_2_with_the_reason():
    result = CliRunner().invoke(policy_cmd, ["--model", "opt-175b", "--gpu-memory", "16GiB", "--cpu-memory",
                                             "64GiB", "--hardware", "h200"])
    assert result.exit_code == 2
    assert "no policy fits opt-175b" in result.output


def test_bad_size_is_a_usage_error():
    result = CliRunner().invoke(policy_cmd, ["--model", "opt-30b", "--gpu-memory", "sixteen"])
    assert result.exit_code == 2 and "cannot parse size 'sixteen'" in result.output


def test_unknown_model_is_a_usage_error():
    result = CliRunner().invoke(policy_cmd, ["--model", "no-such-model", "--hardware", "h200"])
    assert result.exit_code == 2 and "no-such-model" in result.output


@pytest.mark.parametrize("cmd", [policy_cmd, profile_cmd])
def test_help_has_an_example(cmd):
    result = CliRunner().invoke(cmd, ["--help"])
    assert result.exit_code == 0 and "Example:" in result.output and "llmops" in result.output


def test_profile_measures_once_and_prints_json(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPS_CACHE_DIR", str(tmp_path))
    import engine.calibrate.measure as measure_mod

    calls = []
    monkeypatch.setattr(measure_mod, "measure", lambda device, **kw: calls.append(device) or default_cpu_profile())
    runner = CliRunner()
    first = runner.invoke(profile_cmd, ["--device", "cpu", "--json"])
    assert first.exit_code == 0, first.output
    assert json.loads(first.output)["device_type"] == "cpu"
    second = runner.invoke(profile_cmd, ["--device", "cpu"])
    assert second.exit_code == 0 and "host -> device" in second.output
    assert len(calls) == 1
    runner.invoke(profile_cmd, ["--device", "cpu", "--refresh"])
    assert len(calls) == 2


def test_policy_gpus_explains_the_split():
    """--gpus 2: the CPU budget is shared (each GPU plans within half), the layers split into two stages."""
    one = json.loads(CliRunner().invoke(policy_cmd, BASE + ["--json"]).output)
    result = CliRunner().invoke(policy_cmd, BASE + ["--gpus", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    split = data["devices"]
    assert data["budgets_bytes"]["cpu"] == 50 * 1024**3 and split["num_gpus"] == 2
    assert data["predicted_peak_bytes"]["cpu"] <= 50 * 1024**3
    assert split["predicted_tokens_per_s"] == pytest.approx(2 * data["predicted_tokens_per_s"])
    if data["policy"]["w_gpu"] < 1:
        assert split["parallel"] == "pipeline" and split["micro_batches"] == 2
        assert [s["layers"] for s in split["stages"]][0][0] == 0 and split["stages"][-1]["layers"][1] == 47
        assert split["stages"][0]["layers"][1] + 1 == split["stages"][1]["layers"][0]
    assert one["devices"] is None
    text = CliRunner().invoke(policy_cmd, BASE + ["--gpus", "2"]).output
    assert "2 GPUs" in text and ("stage 1  layers" in text or "data-parallel" in text)


def test_profile_text_shows_the_fused_kernels_costs_where_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPS_CACHE_DIR", str(tmp_path))
    import engine.calibrate.measure as measure_mod

    measured = replace(default_cpu_profile(), gpu_q4_attention_kv_ns=1.25, gpu_q4_attention_q_ns=0.5)
    monkeypatch.setattr(measure_mod, "measure", lambda device, **kw: measured)
    result = CliRunner().invoke(profile_cmd, ["--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "1.250 ns per kv head + 0.500 ns per query head, a position" in result.output
