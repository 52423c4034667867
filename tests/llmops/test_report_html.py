"""`llmops run ... --report out/report.html`: the run report JSON (version 2) from a real engine on a tiny
random Llama (CPU), its HTML page's structure (plots as inline SVG, the JSON's numbers, nothing fetched from
outside the page) and, where Chromium is installed, a headless browser's screenshot holding each plot."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from helpers.fake_pipeline import fake_engine_report
from llmops.cli import main
from llmops.report import build_report

pytest.importorskip("matplotlib")
from llmops import report_html  # noqa: E402 (after the skip: the `report` extra)

PIPELINE = """\
name: report-test
cache_dir: false
model: {model}
engine: {{dtype: float32, device: cpu}}
source:
  csv: {data}
steps:
  - llm_map: {{output: label, template: "Label: {{body}}", choices: [bug, billing, other], max_new_tokens: 4}}
  - llm_map: {{output: fields, template: "Extract: {{body}}", schema: {{n: integer}}, max_new_tokens: 12}}
sink:
  parquet: {out}
"""
ROWS = 10


@pytest.fixture(scope="module")
def ran(tiny_llama, tmp_path_factory):
    """One CLI run with --report on the tiny model: (the JSON report, the HTML text, the HTML path)."""
    root = tmp_path_factory.mktemp("report")
    model = tiny_llama
    data = root / "in.csv"
    data.write_text("id,body\n" + "".join(f"{i},ticket {i} about an invoice\n" for i in range(ROWS)))
    pipe = root / "p.yaml"
    pipe.write_text(PIPELINE.format(model=model, data=data, out=root / "out.parquet"))
    html_path = root / "out" / "report.html"
    result = CliRunner().invoke(main, ["run", str(pipe), "--report", str(html_path), "--allow-errors"])
    assert result.exit_code == 0, result.output
    report = json.loads((root / "out.parquet.report.json").read_text())
    return report, html_path.read_text(), html_path


def test_report_json_splits_the_time_and_compares_prediction_with_measurement(ran):
    report, _, _ = ran
    assert report["version"] == 2
    split, run = report["time"], report["run"]
    assert sum(split.values()) == pytest.approx(run["seconds"], abs=1e-6)
    assert split["prefill"] > 0 and split["decode"] >= 0 and split["grammar_mask"] > 0 and split["load"] > 0
    for step in report["llm_steps"]:
        assert sum(step["throughput"]["rows"]) == ROWS
        assert step["engine"]["generated_tokens"] == step["generated_tokens"]
        assert sum(v for k, v in step["time"].items() if k != "other") <= step["seconds"] + 1e-6
        cmp = step["comparison"]
        assert cmp["predicted_tokens_per_s"] > 0 and cmp["engine_tokens_per_s"] > 0      # plan from the cost model
        assert cmp["peak_bytes"]["gpu"]["predicted"] > 0 and cmp["peak_bytes"]["gpu"]["measured"] > 0


def test_html_has_the_plots_and_the_numbers_and_fetches_nothing(ran):
    report, page, _ = ran
    for plot in ("plot-time", "plot-confidence", "plot-throughput", "plot-comparison"):
        assert re.search(rf'<div class=plot id={plot}><svg\b', page), plot
    assert page.count("<svg") == 4
    for title in ("Where the time went", "Throughput over time", "Speed: predicted vs measured",
                  "Peak memory per tier"):
        assert title in page                               # plot text stays text (svg.fonttype none)
    run = report["run"]
    for n in (run["source_rows"], run["generated_tokens"], run["prompt_tokens"]):
        assert f"<td>{n:,}</td>" in page
    assert f"{report['llm_steps'][1]['comparison']['predicted_tokens_per_s']:,.1f}" in page
    assert "step 0: label" in page and "step 1: fields" in page
    assert not re.search(r"<script|<link|<img|<iframe|@import|url\(\s*['\"]?(?!#)", page, re.I)
    assert all(ref.startswith("#") for ref in re.findall(r'href="([^"]*)"', page))
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) <= {
        "http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}      # XML namespaces, never loaded


def test_report_without_matplotlib_exits_2_before_running(fake, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "llmops.report_html")
    pipe = tmp_path / "p.yaml"
    pipe.write_text(f"source:\n  csv: {tmp_path / 'in.csv'}\nsteps: []\nsink:\n  parquet: {tmp_path / 'o.parquet'}\n")
    result = CliRunner().invoke(main, ["run", str(pipe), "--report", str(tmp_path / "r.html")])
    assert result.exit_code == 2 and 'pip install "llmops-engine[report]"' in result.output
    assert fake.calls == 0 and not (tmp_path / "o.parquet").exists()


def _browser() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _pixels(png, color: str):
    """(count, mean row) of the screenshot's pixels of exactly `color` ("#rrggbb")."""
    import numpy as np

    rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
    hit = (np.abs(png[:, :, :3].astype(np.int16) - rgb) <= 2).all(axis=2)
    rows = np.nonzero(hit)[0]
    return int(hit.sum()), float(rows.mean()) if rows.size else -1.0


@pytest.mark.skipif(_browser() is None, reason="no Chromium on this machine (apt-get install chromium)")
def test_headless_browser_screenshot_shows_every_plot(ran, tmp_path):
    from matplotlib import image

    _, _, html_path = ran
    shot = tmp_path / "shot.png"
    done = subprocess.run([_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--user-data-dir={tmp_path / 'profile'}", "--host-resolver-rules=MAP * ~NOTFOUND",
                           "--window-size=1200,4200", f"--screenshot={shot}", html_path.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert shot.exists(), done.stderr[-2000:]
    png = (image.imread(shot) * 255).round()                        # [h, w, 3 or 4] in 0..255
    where = {}
    for name, color in (("decode", report_html.PART_COLORS["decode"]),
                        ("prefill", report_html.PART_COLORS["prefill"]),
                        ("step 0", report_html.STEP_COLORS[0]), ("step 1", report_html.STEP_COLORS[1]),
                        ("predicted", report_html.PREDICTED_COLOR), ("measured", report_html.MEASURED_COLOR)):
        count, row = _pixels(png, color)
        assert count > 150, f"{name} ({color}): {count} pixels"
        where[name] = row
    # the page's order: where the time went, then throughput over time, then predicted vs measured
    assert where["prefill"] < where["step 0"] < where["predicted"]


def test_reports_without_engine_figures_or_steps_still_render(tmp_path):
    """A fake engine (no stats, no plan) and the Ray runner's report (no per-step figures) render too."""
    result, report = fake_engine_report(tmp_path)
    page = report_html.render_html(report)
    assert page.count("<svg") == 3 and "The engine reported no plan." in page
    assert "<td>cut by max_new_tokens</td><td>1</td>" in page and result.failed_rows == 1
    ray_like = build_report({"name": "r", "seconds": 2.0}, {"setup": 0.5, "ray_dataset_and_sink": 1.25}, [])
    page = report_html.render_html(ray_like)
    assert page.count("<svg") == 1 and "Ray dataset + sink" in page and "Throughput over time" not in page
