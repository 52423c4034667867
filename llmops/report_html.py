"""The run report as one self-contained HTML page (`llmops run ... --report out/report.html`).

`render_html(report)` turns the JSON run report (`llmops.report`, version 2) into a page people would
rather look at than read: the run's figures and failures by reason as tables; the rows and seconds of each
model (a cascade's, `llmops.cascade`); plots of where the time went (load, plan, prefill, decode, grammar
masks, cache, sink...), throughput over time (rows finished per second, per llm_map step), the confidence
of constrained outputs (a histogram per step that has any) and, per step, the cost model's prediction beside
the measurement (generated tokens/s, peak memory per tier); and each step's policy.

Why matplotlib, rendering inline SVG: a plot is drawn once, when the run ends, and only has to be looked
at, so a static image serves; matplotlib is the most widely kept Python plotting library, draws without a
display or a browser (the `Figure` API, no pyplot and no global state), and its SVG needs no script, no
font file and no network, so the page opens offline and in a mail attachment. Text stays `<text>` (the
`svg.fonttype` "none" setting): the page is a few tens of kB and its labels can be searched. plotly would
inline ~3.5 MB of JavaScript for interactivity nobody needs in a report. Nothing on the page refers to
anything outside it (tests/llmops/test_report_html.py checks that, and a headless browser's screenshot).

matplotlib is the `report` extra (`pip install "llmops-engine[report]"`); the CLI imports this module only when
`--report` is given.
"""
from __future__ import annotations

import html
import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from llmops.core import write_text_atomic
from llmops.report import TIERS

# One colour per plotted quantity (tests/llmops/test_report_html.py finds each in a browser's screenshot).
PART_COLORS = {"source": "#8c564b", "load": "#9467bd", "place_weights": "#c5b0d5", "plan": "#e377c2",
               "prefill": "#ff7f0e", "decode": "#1f77b4", "grammar_mask": "#2ca02c", "cache": "#bcbd22",
               "sink": "#17becf", "setup": "#7f7f7f", "ray_dataset_and_sink": "#aec7e8", "other": "#d9d9d9"}
STEP_COLORS = ("#e41a1c", "#377eb8", "#4daf4a", "#984ea3", "#a65628", "#f781bf")
PREDICTED_COLOR, MEASURED_COLOR = "#f2b134", "#3b5ba5"
CONFIDENCE_COLOR = "#6a3d9a"
PART_ORDER = ("source", "setup", "load", "place_weights", "plan", "prefill", "decode", "grammar_mask", "cache",
              "sink", "ray_dataset_and_sink", "other")
PART_LABELS = {"place_weights": "place weights", "grammar_mask": "grammar masks",
               "ray_dataset_and_sink": "Ray dataset + sink"}
GIB = 1024 ** 3
STYLE = """body{font-family:sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.8em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:.25em .6em;text-align:right}
th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}.plot svg{max-width:100%;height:auto}
.note{color:#666;font-size:.9em}"""


def _svg(fig: Figure) -> str:
    """The figure as an inline `<svg>` element (no XML prolog, no RDF metadata, text as text)."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return re.sub(r"<metadata>.*?</metadata>\s*", "", text[text.index("<svg"):], flags=re.S)


def _num(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else html.escape(str(value))


def _table(head: list[str], rows: list[list[Any]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c if isinstance(c, str) else _num(c)}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def _step_name(step: dict[str, Any]) -> str:
    return f"step {step.get('step')}: {step.get('output') or step.get('kind') or 'llm_map'}"


def time_plot(split: dict[str, float]) -> str:
    """Where the run's time went: one horizontal bar cut into the parts, seconds labelled."""
    fig = Figure(figsize=(10, 1.9))
    ax = fig.subplots()
    left = 0.0
    for part, seconds in split.items():
        if seconds <= 0:
            continue
        ax.barh([0], [seconds], left=left, color=PART_COLORS.get(part, "#999999"), edgecolor="white",
                label=f"{PART_LABELS.get(part, part)} {seconds:.2f} s")
        left += seconds
    ax.set_yticks([])
    ax.set_xlabel("seconds")
    ax.set_title("Where the time went")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=5, frameon=False, fontsize=8)
    return _svg(fig)


def _step_panels(steps: list[dict[str, Any]], title: str, xlabel: str,
                 draw: Callable[[Axes, int, dict[str, Any]], None]) -> str:
    """A panel per step (one, empty, when there are none), stacked: `draw(ax, n, step)` fills the n-th; each is
    titled with its step's name, the stack with `title`, the bottom axis with `xlabel`. The SVG."""
    fig = Figure(figsize=(10, 0.6 + 1.7 * max(1, len(steps))))
    axes = fig.subplots(max(1, len(steps)), 1, squeeze=False)[:, 0]
    for n, (ax, step) in enumerate(zip(axes, steps)):
        draw(ax, n, step)
        ax.set_title(_step_name(step), fontsize=9, loc="left")
    axes[0].set_title(title, fontsize=11)
    axes[-1].set_xlabel(xlabel)
    fig.tight_layout()
    return _svg(fig)


def throughput_plot(steps: list[dict[str, Any]]) -> str:
    """Rows finished per second over each llm_map step's run (its `throughput` buckets), a panel per step."""
    def draw(ax: Axes, n: int, step: dict[str, Any]) -> None:
        clock = step.get("throughput") or {}
        width, rows = float(clock.get("bucket_s") or 1.0), clock.get("rows") or []
        ax.bar([i * width for i in range(len(rows))], [r / width for r in rows], width=width, align="edge",
               color=STEP_COLORS[n % len(STEP_COLORS)], edgecolor="white", linewidth=0.5)
        ax.set_ylabel("rows/s")

    return _step_panels(steps, "Throughput over time (rows finished per second)", "seconds since the step began",
                        draw)


def confidence_plot(steps: list[dict[str, Any]]) -> str:
    """The answered rows' confidence per step (`confidence_bins`: 10 bins over [0, 1]), a panel per step."""
    def draw(ax: Axes, n: int, step: dict[str, Any]) -> None:
        bins = step.get("confidence_bins") or []
        width = 1.0 / max(1, len(bins))
        ax.bar([i * width for i in range(len(bins))], bins, width=width, align="edge", color=CONFIDENCE_COLOR,
               edgecolor="white", linewidth=0.5)
        ax.set_xlim(0, 1)
        ax.set_ylabel("rows")

    return _step_panels(steps, "Confidence of the answers (rows per bin)", "confidence", draw)


def comparison_plot(steps: list[dict[str, Any]]) -> str:
    """Per step: predicted vs measured generated tokens/s, and peak memory per tier (GiB)."""
    fig = Figure(figsize=(10, 3.4))
    speed, memory = fig.subplots(1, 2)
    names = [f"step {s.get('step')}" for s in steps]
    cmp = [s.get("comparison") or {} for s in steps]
    xs = list(range(len(steps)))
    speed.bar([x - 0.2 for x in xs], [c.get("predicted_tokens_per_s") or 0 for c in cmp], 0.4,
              color=PREDICTED_COLOR, label="predicted (cost model)")
    speed.bar([x + 0.2 for x in xs], [c.get("engine_tokens_per_s") or 0 for c in cmp], 0.4,
              color=MEASURED_COLOR, label="measured (engine time)")
    speed.set_xticks(xs, names)
    speed.set_ylabel("generated tokens/s")
    speed.set_title("Speed: predicted vs measured")
    if any(c.get("predicted_tokens_per_s") for c in cmp):
        speed.set_yscale("log")
    speed.legend(frameon=False, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    labels, predicted, measured = [], [], []
    for name, c, step in zip(names, cmp, steps):
        for tier, label in zip(TIERS, tier_labels(step)):
            peak = (c.get("peak_bytes") or {}).get(tier) or {}
            if peak.get("predicted") or peak.get("measured"):
                labels.append(f"{name}\n{label}")
                predicted.append((peak.get("predicted") or 0) / GIB)
                measured.append((peak.get("measured") or 0) / GIB)
    ys = list(range(len(labels)))
    memory.bar([y - 0.2 for y in ys], predicted, 0.4, color=PREDICTED_COLOR, label="predicted")
    memory.bar([y + 0.2 for y in ys], measured, 0.4, color=MEASURED_COLOR, label="measured (executor budget)")
    memory.set_xticks(ys, labels, fontsize=8)
    memory.set_ylabel("peak GiB")
    memory.set_title("Peak memory per tier")
    memory.legend(frameon=False, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
    fig.tight_layout()
    return _svg(fig)


def tier_labels(step: dict[str, Any]) -> tuple[str, ...]:
    """How the report names the memory tiers of a step: on a CPU the compute tier is the "device"."""
    return ("device", *TIERS[1:]) if (step.get("plan") or {}).get("device_type") == "cpu" else TIERS


def _summary(report: dict[str, Any]) -> str:
    run = report.get("run") or {}
    rows = [["rows read", run.get("source_rows")], ["rows written", run.get("rows_written")],
            ["generated tokens", run.get("generated_tokens")], ["prompt tokens", run.get("prompt_tokens")],
            ["generated tokens/s (wall)", run.get("tokens_per_s")], ["cache hits (rows)", run.get("cache_hits")],
            ["failed rows", run.get("failed_rows")], ["seconds", run.get("seconds")]]
    return _table(["", "value"], rows)


def _failures(steps: list[dict[str, Any]]) -> str:
    rows = [[_step_name(s), reason, n] for s in steps for reason, n in sorted((s.get("failures") or {}).items())]
    return _table(["step", "reason", "rows"], rows) if rows else "<p>No row failed.</p>"


def _steps_table(steps: list[dict[str, Any]]) -> str:
    head = ["step", "rows", "generated", "cache hits", "deduped", "nulls", "errors", "cut", "tokens", "seconds"]
    rows = [[_step_name(s), s.get("rows"), s.get("generated_rows"), s.get("cache_hits"), s.get("deduped"),
             s.get("nulls"), s.get("errors"), s.get("truncated"), s.get("generated_tokens"), s.get("seconds")]
            for s in steps]
    return _table(head, rows)


def _models_table(steps: list[dict[str, Any]]) -> str:
    """Rows answered and seconds per model of each step (a cascade's models in order), rows escalated."""
    rows = []
    for s in steps:
        answered, seconds = s.get("rows_by_model") or {}, s.get("seconds_by_model") or {}
        for model in {**seconds, **answered}:
            rows.append([_step_name(s), model, answered.get(model, 0), seconds.get(model), s.get("escalated", 0)])
    return _table(["step", "model", "rows answered", "seconds", "rows escalated (step)"], rows)


def _time_table(split: dict[str, float]) -> str:
    total = sum(split.values()) or 1.0
    return _table(["part", "seconds", "share %"],
                  [[PART_LABELS.get(k, k), f"{v:.3f}", 100 * v / total] for k, v in split.items()])


def _policy(step: dict[str, Any]) -> str:
    plan, cmp = step.get("plan") or {}, step.get("comparison") or {}
    policy = plan.get("policy") or {}
    head = f"<h3>{html.escape(_step_name(step))}</h3>"
    if not policy:
        return head + "<p class=note>The engine reported no plan.</p>"
    shape = f"{policy.get('num_gpu_batches')} batch(es) x {policy.get('gpu_batch_size')}"
    flags = ", ".join(f for f in ("overlap", "cpu_attention", "compress_weights", "compress_cache", "cpu_dense_copy")
                      if policy.get(f)) or "none"
    place = [[what] + [f"{100 * float(policy.get(f'{key}_{t}', 0.0)):.0f}%" for t in TIERS]
             for what, key in (("weights", "w"), ("kv cache", "cache"), ("hidden", "act"))]
    speed = [["predicted (cost model)", cmp.get("predicted_tokens_per_s")],
             ["measured over engine time", cmp.get("engine_tokens_per_s")],
             ["measured over the step's wall time", cmp.get("wall_tokens_per_s")],
             ["measured / predicted", _ratio(cmp.get("measured_over_predicted"))]]
    peaks = cmp.get("peak_bytes") or {}
    memory = [[label, _gib((peaks.get(t) or {}).get("predicted")), _gib((peaks.get(t) or {}).get("measured"))]
              for t, label in zip(TIERS, tier_labels(step))]
    return (head + f"<p>Source: {html.escape(str(plan.get('source')))}; block {shape}; flags {flags}.</p>"
            + _table(["placement", *tier_labels(step)], place) + _table(["generated tokens/s", "value"], speed)
            + _table(["peak memory", "predicted", "measured"], memory))


def _ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def _gib(n: Any) -> str:
    return "—" if n is None else f"{n / GIB:.3f} GiB"


def render_html(report: dict[str, Any]) -> str:
    """The page for a run report (the JSON object `llmops.report.build_report` returns)."""
    run, steps = report.get("run") or {}, report.get("llm_steps") or []
    times = report.get("time") or {}
    split = {k: float(times[k]) for k in sorted(times, key=lambda k: (k not in PART_ORDER, PART_ORDER.index(k)
                                                                       if k in PART_ORDER else 0, k))}
    name = html.escape(str(run.get("name") or "pipeline"))
    parts = [f"<h1>Run report: {name}</h1>",
             f"<p class=note>Written {html.escape(str(report.get('created', '')))} to "
             f"{html.escape(str(run.get('output', '')))}; report version {report.get('version')}.</p>",
             "<h2>Figures</h2>", _summary(report)]
    if steps:
        parts += ["<h3>llm_map steps</h3>", _steps_table(steps), "<h3>Failures by reason</h3>", _failures(steps)]
        if any(s.get("rows_by_model") or s.get("seconds_by_model") for s in steps):
            parts += ["<h3>Models</h3>", _models_table(steps)]
    parts += ["<h2>Where the time went</h2>", f"<div class=plot id=plot-time>{time_plot(split)}</div>",
              _time_table(split)]
    if steps:
        rated = [s for s in steps if any(s.get("confidence_bins") or [])]
        if rated:
            parts += ["<h2>Confidence</h2>",
                      "<p class=note>How sure each answering model was of its constrained outputs "
                      "(engine.decoding.confidence).</p>",
                      f"<div class=plot id=plot-confidence>{confidence_plot(rated)}</div>"]
        parts += ["<h2>Throughput over time</h2>", f"<div class=plot id=plot-throughput>{throughput_plot(steps)}</div>",
                  "<h2>Policy: predicted vs measured</h2>",
                  "<p class=note>The cost model predicts a block's prefill + decode throughput; the measured "
                  "speed is over the engine's prefill, decode and grammar time. Peak memory is what the "
                  "executor's budget counted per tier.</p>",
                  f"<div class=plot id=plot-comparison>{comparison_plot(steps)}</div>", *(_policy(s) for s in steps)]
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            f"<title>llmops run report: {name}</title><style>{STYLE}</style></head><body>"
            + "\n".join(parts) + "</body></html>\n")


def write_html(report: dict[str, Any], path: str | Path) -> Path:
    """Render `report` and write it to `path` atomically (parent folders made); returns the path."""
    target = Path(path)
    write_text_atomic(target, render_html(report))
    return target
