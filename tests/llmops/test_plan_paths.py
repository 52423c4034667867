"""One planning path: `llmops policy`, `llmops run --dry-run` and `llmops run` show and use the same plan for the
same settings (a tiny Llama on the CPU with a fixed hardware profile), and the plan cache a preview reads (a preset
on the built-in H200 profile): a hit on the second call, a corrupt file rebuilt, another budget a miss, a plan a
run refined by trials shown by the preview that follows."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from engine.calibrate.machine import default_cpu_profile
from engine.calibrate.planning import Plan, PlanCache
from engine.calibrate.profile_cache import profile_cache_path, save_profile
from engine.policy.estimate import PolicyEstimate
from engine.policy.hardware import GIB
from engine.policy.policy import Policy
from llmops import engines
from llmops.cli import main

ROWS = ["short", "a somewhat longer row of text", "mid length row", "x y z", "the longest row of them all here",
        "another row"]


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A cache folder holding a fixed, measured-looking CPU profile (12 GiB of RAM), so every planner in the test
    plans with it."""
    monkeypatch.setenv("LLMOPS_CACHE_DIR", str(tmp_path / "llmops-cache"))
    profile = default_cpu_profile()
    fixed = type(profile)(**{**profile.to_dict(), "gpu_memory_bytes": 12 * GIB, "cpu_memory_bytes": 12 * GIB,
                             "source": "measured", "slot_decode_ms": 0.2, "slot_off_cache_ms": 0.1})
    save_profile(fixed, profile_cache_path("cpu"))
    engines.clear()
    yield
    engines.clear()


def _pipeline(tmp_path: Path, model: Path) -> Path:
    (tmp_path / "rows.csv").write_text("x\n" + "\n".join(ROWS) + "\n")
    spec = {"name": "p", "cache_dir": str(tmp_path / "results"), "model": str(model),
            "engine": {"device": "cpu", "dtype": "float32"},
            "source": {"csv": str(tmp_path / "rows.csv")},
            "steps": [{"llm_map": {"output": "y", "template": "Say: {x}", "max_new_tokens": 3, "chat": False}}],
            "sink": {"parquet": str(tmp_path / "out.parquet")}}
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps(spec))
    return path


def _invoke(args: list[str]) -> str:
    """The command's stdout (notes go to stderr)."""
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result.stdout


def _policy_args(model: Path | str, w: dict) -> list[str]:
    return ["policy", "--model", str(model), "--prompt-len", str(w["prompt_len"]), "--max-prompt-len",
            str(w["max_prompt_len"]), "--gen-len", str(w["gen_len"]), "--num-prompts", str(w["num_prompts"]),
            "--shared-prefix-len", str(w["shared_prefix_len"])]


def _plan_lines(text: str) -> list[str]:
    """The explanation's lines after its first ("Plan: ... in N s"), without the indent a dry run adds."""
    lines = [line.strip() for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("Plan:"))
    end = next(i for i, line in enumerate(lines) if line.startswith("Peak memory"))
    return lines[start + 1:end + 1]


def test_policy_dry_run_and_run_show_and_use_one_plan(tiny_llama, tmp_path, machine):
    pipeline = _pipeline(tmp_path, tiny_llama)
    dry = json.loads(_invoke(["run", str(pipeline), "--dry-run", "--json"]))
    job = dry["job_plan"]
    assert job["chosen_by"] == "cost model" and job["pending_trials"] == 0
    assert job["workload"]["num_prompts"] == 8 and job["workload"]["gen_len"] == 3
    args = _policy_args(tiny_llama, job["workload"]) + ["--dtype", "float32"]
    policy = json.loads(_invoke(args + ["--json"]))
    assert policy["policy"] == job["policy"] and policy["workload"] == job["workload"]
    assert policy["budgets_bytes"] == job["budgets_bytes"] == {"gpu": 12 * GIB, "cpu": 0, "disk": 0}
    assert "this machine" in policy["profile"]
    assert _plan_lines(_invoke(args)) == _plan_lines(_invoke(["run", str(pipeline), "--dry-run"]))
    engines.clear()                                    # the run plans in an engine of its own
    _invoke(["run", str(pipeline), "--json"])
    report = json.loads(Path(f"{tmp_path / 'out.parquet'}.report.json").read_text())
    assert report["llm_steps"][0]["plan"]["policy"] == job["policy"]
    assert pq.read_table(tmp_path / "out.parquet").num_rows == len(ROWS)


H200 = ["--model", "tiny-llama", "--hardware", "h200", "--prompt-len", "100", "--gen-len", "8", "--num-prompts",
        "1000", "--json"]


def test_plan_cache_hit_rebuilt_when_corrupt_missed_for_another_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPS_CACHE_DIR", str(tmp_path))
    first = json.loads(_invoke(["policy", *H200]))
    assert (first["source"], first["chosen_by"]) == ("search", "cost model")
    path = Path(first["cache_file"])
    assert path.parent == tmp_path / "plans"
    second = json.loads(_invoke(["policy", *H200]))
    assert second["source"] == "disk" and second["cache_file"] == str(path) and second["policy"] == first["policy"]
    path.write_text(path.read_text()[:50])
    rebuilt = json.loads(_invoke(["policy", *H200]))
    assert rebuilt["source"] == "search" and rebuilt["policy"] == first["policy"]
    assert json.loads(_invoke(["policy", *H200]))["source"] == "disk"
    other = json.loads(_invoke(["policy", *H200, "--gpu-memory", "8GiB"]))
    assert other["source"] == "search" and other["cache_file"] != str(path)
    assert other["budgets_bytes"]["gpu"] == 8 * GIB and first["budgets_bytes"]["gpu"] == 139 * GIB


def test_a_preview_says_trials_will_refine_and_shows_the_refined_plan_after_a_run(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPS_CACHE_DIR", str(tmp_path))
    pending = json.loads(_invoke(["policy", *H200, "--trials", "4"]))
    assert pending["chosen_by"] == "cost model" and pending["pending_trials"] == 4
    assert "measures the best 4 candidates" in _invoke(["policy", *H200[:-1], "--trials", "4"])
    path = Path(pending["cache_file"])
    data = json.loads(path.read_text())            # what a run's trials store: the same key, another policy
    refined = Policy(gpu_batch_size=3)
    trial = {"policy": refined.to_dict(), "predicted_tokens_per_s": 60.0, "trial_tokens_per_s": 50.0}
    est = PolicyEstimate(refined, 50.0, 0.1, 0.2, {"gpu": GIB, "cpu": 0, "disk": 0}, {}, {"trials": [trial]})
    PlanCache(path.parent).put(data["key"], Plan(refined, None, "trials", "trials", est))
    after = json.loads(_invoke(["policy", *H200, "--trials", "4"]))
    assert after["source"] == "disk" and after["chosen_by"] == "trials" and after["pending_trials"] == 0
    assert after["policy"] == refined.to_dict()
    assert json.loads(_invoke(["policy", *H200]))["policy"] == refined.to_dict()    # trials or not: one truth
