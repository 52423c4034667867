"""What a user sees while and after a job runs, on the fake engine: a display that moves per decode step
with an ETA for the generation left, log lines at -v and -vv, a failed run that keeps the sink it would
replace, the reason of each failed row, device-neutral words on a CPU, and a note when the CPU's hardware
profile is the untuned default."""
from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from engine.calibrate.machine import default_cpu_profile
from helpers.fake_engine import FakeLLM
from llmops import core
from llmops.cli import main
from llmops.core import MapSpec, map_table
from llmops.progress import Progress, format_eta
from llmops.report_html import tier_labels
from llmops.summary import describe_failures


class SteppingLLM(FakeLLM):
    """A fake engine with the facade's hooks: `steps` decode steps per block reported through `on_step`, then
    each row through `on_finished`, then the block; `plan` returns `FakePlan`."""

    def __init__(self, *, steps: int = 3, **kw) -> None:
        super().__init__(**kw)
        self.steps = steps

    def plan(self, prompts, params=None, *, rows=None, measure=True):
        return FakePlan()

    def stream(self, prompts, params=None, *, plan=None, on_finished=None, on_step=None):
        for group in super().stream(prompts, params):
            for _ in range(self.steps):
                if on_step is not None:
                    on_step(len(group))
            for idx, completion in group:
                if on_finished is not None:
                    on_finished(idx, completion)
            yield group


class FakePlan:
    predicted_tokens_per_s = 5.0

    def explain(self) -> str:
        return "Plan: test plan\n  weights    device 100.0%"


class Recorder:
    """Stands in for `llmops.progress.Progress`: records the order of what the run reports."""

    last: "Recorder | None" = None

    def __init__(self, total, *, enabled=None, desc="llm_map"):
        self.events: list[tuple[str, int]] = []
        Recorder.last = self

    def expect(self, rows, max_new_tokens, predicted_tokens_per_s=None):
        self.events.append(("expect", rows))

    def step(self, tokens):
        self.events.append(("step", tokens))

    def idle(self):
        self.events.append(("idle", 0))

    def advance(self, rows, *, tokens=0, tokens_per_s=None):
        self.events.append(("row", rows))

    def grow(self, rows):
        pass

    def update(self, rows, **kw):
        self.events.append(("block", rows))

    def close(self):
        pass


def test_the_display_moves_per_decode_step_before_any_row_finishes(monkeypatch):
    monkeypatch.setattr(core, "Progress", Recorder)
    table = pa.table({"body": [f"row {i}" for i in range(4)]})
    map_table(table, MapSpec("{body}"), engine=SteppingLLM(block_size=4), cache_dir=False, progress=True).ordered()
    kinds = [kind for kind, _ in Recorder.last.events]
    assert kinds[:5] == ["expect", "step", "step", "step", "row"] and kinds.count("idle") == 1
    assert sum(n for kind, n in Recorder.last.events if kind == "step") == 3 * 4


def test_eta_is_for_the_generation_left_not_the_rows_served_from_the_cache():
    bar = Progress(16, enabled=False)
    bar.update(8, tokens_per_s=0.0, cache_hits=8, errors=0)                   # half the rows were cached
    bar.expect(8, max_new_tokens=10, predicted_tokens_per_s=2.0)
    assert bar.eta(now=bar.began) == pytest.approx(40.0)                      # 8 rows x 10 tokens at 2 tok/s
    bar.step(8)
    assert bar.eta(now=bar.began + 4) == pytest.approx((80 - 8) / 2.0)       # measured: 8 tokens in 4 s
    for _ in range(4):
        bar.advance(1, tokens=2)                                              # rows stop early: 2 tokens each
    assert bar.eta(now=bar.began + 4) == pytest.approx((8 * 2 - 8) / 2.0)
    assert format_eta(75) == "ETA 1:15" and format_eta(None) == "ETA ?" and format_eta(3725) == "ETA 1:02:05"


def test_the_real_bar_shows_steps_tokens_and_eta(capsys):
    bar = Progress(4, enabled=True)
    bar.expect(4, max_new_tokens=8, predicted_tokens_per_s=4.0)
    bar.step(4)
    bar.close()
    err = capsys.readouterr().err
    assert "0/4 rows" in err and "step 1" in err and "4 tok" in err and "ETA" in err


def test_verbose_logs_the_plan_and_blocks_and_very_verbose_each_step(caplog):
    caplog.set_level(logging.DEBUG, logger="llmops")
    table = pa.table({"body": [f"row {i}" for i in range(4)]})
    map_table(table, MapSpec("{body}"), engine=SteppingLLM(block_size=2, steps=2), cache_dir=False).ordered()
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("4 rows to generate" in m and "Plan: test plan" in m and "weights" in m for m in info)
    assert sum(m.startswith("block of 2 rows done in") for m in info) == 2
    assert sum(m.startswith("step ") for m in debug) == 4


PIPE = "cache_dir: false\nsource: {{csv: {data}}}\nsteps:\n  - llm_map: {{output: o, template: '{{body}}', \
schema: {{n: integer}}}}\nsink: {{parquet: {out}}}\n"


def _pipeline(tmp_path: Path, bodies: list[str]) -> tuple[Path, Path]:
    data, out = tmp_path / "in.csv", tmp_path / "out.parquet"
    data.write_text("id,body\n" + "".join(f"{i},{b}\n" for i, b in enumerate(bodies)))
    pipe = tmp_path / "p.yaml"
    pipe.write_text(PIPE.format(data=data, out=out))
    return pipe, out


def test_a_failed_run_keeps_the_sink_and_says_where_its_rows_are(tmp_path, fake):
    pipe, out = _pipeline(tmp_path, ["fine", "CUT here", "good"])    # the fake cuts a "CUT" row's JSON
    out.write_bytes(b"the previous run's rows")
    failed = CliRunner().invoke(main, ["run", str(pipe)])
    held = tmp_path / "out.llmops-staged.parquet"
    assert failed.exit_code == 1 and out.read_bytes() == b"the previous run's rows"
    assert pq.read_table(held).num_rows == 3 and str(held) in failed.stderr and str(out) in failed.stderr
    assert "steps[0] row 1: output cut by max_new_tokens" in failed.stderr
    published = CliRunner().invoke(main, ["run", str(pipe), "--allow-errors"])
    assert published.exit_code == 0 and pq.read_table(out).num_rows == 3


def test_many_failed_rows_are_counted_by_reason_with_a_few_examples(tmp_path, fake):
    pipe, out = _pipeline(tmp_path, [f"CUT {i}" for i in range(12)] + ["fine"])
    result = CliRunner().invoke(main, ["run", str(pipe)])
    assert result.exit_code == 1 and "12 cut by max_new_tokens" in result.stderr
    assert result.stderr.count("  e.g. steps[0] row ") == 3 and pq.read_table(out).num_rows == 13  # nothing to keep


def test_describe_failures_lists_few_and_counts_many():
    few = describe_failures(2, {"engine error": 2}, [("row 1", "boom"), ("row 4", "bang")])
    assert few == ["  row 1: boom", "  row 4: bang"]
    many = describe_failures(11, {"prompt too long": 3, "engine error": 8}, [(f"row {i}", "x") for i in range(10)])
    assert many[:2] == ["  8 engine error", "  3 prompt too long"] and len(many) == 5
    assert describe_failures(0, {}, []) == []


def test_plans_and_reports_speak_of_the_device_on_a_cpu():
    plan = core.plan_model("opt-125m", prompt_len=200, gen_len=4, num_prompts=16, profile=default_cpu_profile())
    text = plan.explain()
    assert "gpu" not in text.lower() and "batch(es) x" in text and "device 100.0%" in text
    assert tier_labels({"plan": plan.to_dict()}) == ("device", "cpu", "disk")
    assert tier_labels({"plan": {"device_type": "cuda"}}) == ("gpu", "cpu", "disk")


@pytest.mark.parametrize("source, noted", [("default", True), ("measured", False)])
def test_run_notes_an_untuned_cpu_profile_once(tmp_path, fake, monkeypatch, source, noted):
    profile = default_cpu_profile()
    monkeypatch.setattr(core, "default_device", lambda: "cpu")
    monkeypatch.setattr(core, "hardware_profile", lambda where="local": (type(profile)(**{**profile.to_dict(),
                                                                                           "source": source}), ""))
    pipe, _ = _pipeline(tmp_path, ["fine", "good"])
    result = CliRunner().invoke(main, ["run", str(pipe)])
    assert result.exit_code == 0
    assert result.stderr.count("llmops profile") == (1 if noted else 0)
    assert CliRunner().invoke(main, ["-q", "run", str(pipe)]).stderr == ""
