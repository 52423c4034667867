"""Where a traced run's device time went, phase by phase: a `torch.profiler` trace read as a timeline.

`trace_summary` (benchmarks.common) adds the profiler's events up; this reads them in time. The device's events
(kernels, copies, memsets: name, stream, start, end) are split into phases at the ends of the host's
`SELECT_MARK` ranges (the token selection, which waits for each step's logits, so the device has finished
the step when it ends): everything before the first end is the prefill, the rest the decode steps. Per
phase: the wall, each stream's busy time (the union of its events), the compute stream's idle gaps (the
device waiting for the host or for a copy), the kernel seconds by category (`CATEGORIES`: GEMM, attention,
Triton, elementwise, cat, copy...) and the top kernels by seconds. `write_events` saves the compact timeline
(gzip JSON, written outside the tree: `throughput.py --trace-out /tmp/F.json.gz`) for a look offline; run as
a script, this reads such a file back and prints its phases:

    python benchmarks/profiling/timeline.py /tmp/timeline_wrangle-8L.json.gz
"""
from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

SELECT_MARK = "llmops.select"
GAP_US = 20.0                               # compute-stream gaps shorter than this count as launch spacing
CATEGORIES = (                              # (category, regex on the kernel name), first match wins
    ("copy", r"^Memcpy|^Memset"),
    ("gemm", r"nvjet|gemm|Gemm|sm90_xmma|cutlass.*(?:tensorop|_gemm)|splitKreduce"),
    ("attention", r"fmha|attention|flash|Attention"),
    ("triton", r"^_|triton"),
    ("cat", r"CatArray"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
    ("reduce", r"reduce|Reduce|argmax|softmax"),
    ("index", r"index|gather|scatter|embedding"),
)


class DeviceEvent(NamedTuple):
    name: str
    stream: int
    start_us: float
    end_us: float


def device_events(prof: Any) -> tuple[list[DeviceEvent], list[tuple[float, float]]]:
    """(the device's events sorted by start, the host's `SELECT_MARK` ranges (start, end) in us) of a finished
    `torch.profiler.profile`, on the profiler's one clock."""
    events, marks = [], []
    for e in prof.profiler.kineto_results.events():
        if e.name() == SELECT_MARK:
            if str(e.device_type()).endswith("CPU"):        # the host's range (kineto mirrors it on the device)
                marks.append((e.start_ns() / 1e3, e.end_ns() / 1e3))
        elif str(e.device_type()).endswith("CUDA") and e.duration_ns() > 0:
            events.append(DeviceEvent(e.name(), int(e.device_resource_id()), e.start_ns() / 1e3, e.end_ns() / 1e3))
    return sorted(events, key=lambda e: e.start_us), sorted(marks)


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name):
            return cat
    return "other"


def _union(spans: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """(the total length of the union of `spans`, the gaps between its pieces) for spans sorted by start."""
    busy, gaps, cur = 0.0, [], None
    for s, e in spans:
        if cur is None:
            cur = [s, e]
        elif s > cur[1]:
            busy += cur[1] - cur[0]
            gaps.append((cur[1], s))
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    if cur is not None:
        busy += cur[1] - cur[0]
    return busy, gaps


def phase_summary(events: list[DeviceEvent], start: float, end: float, top: int = 20) -> dict[str, Any]:
    """The device events starting in [start, end) us: wall, per-stream busy seconds, the compute stream's idle
    gaps, kernel seconds and counts by category, the top kernels by seconds."""
    inside = [e for e in events if start <= e.start_us < end]
    if not inside:
        return {"wall_s": 0.0, "events": 0}
    t0, t1 = inside[0].start_us, max(e.end_us for e in inside)
    by_stream: dict[int, list[tuple[float, float]]] = defaultdict(list)
    kernel_by_stream: dict[int, float] = defaultdict(float)
    cats: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    names: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in inside:
        d = e.end_us - e.start_us
        by_stream[e.stream].append((e.start_us, e.end_us))
        c = category(e.name)
        if c != "copy":
            kernel_by_stream[e.stream] += d
        cats[c][0] += d
        cats[c][1] += 1
        names[e.name][0] += d
        names[e.name][1] += 1
    compute = max(kernel_by_stream, key=kernel_by_stream.get) if kernel_by_stream else None
    streams = {}
    for s, spans in by_stream.items():
        busy, _ = _union(spans)
        streams[str(s)] = round(busy / 1e6, 4)
    out: dict[str, Any] = {"wall_s": (t1 - t0) / 1e6, "events": len(inside), "compute_stream": compute,
                           "stream_busy_s": streams}
    _, all_gaps = _union([(e.start_us, e.end_us) for e in inside])
    out["device_idle_s"] = sum(b - a for a, b in all_gaps) / 1e6
    if compute is not None:
        busy, gaps = _union(by_stream[compute])
        long = sorted((b - a for a, b in gaps if b - a >= GAP_US), reverse=True)
        out["compute_busy_s"] = busy / 1e6
        out["compute_gaps"] = {"count": len(gaps), "total_s": sum(b - a for a, b in gaps) / 1e6,
                               f"over_{GAP_US:g}us_count": len(long), f"over_{GAP_US:g}us_s": sum(long) / 1e6,
                               "largest_ms": [round(g / 1e3, 3) for g in long[:10]]}
    out["by_category"] = {c: {"s": round(v[0] / 1e6, 4), "calls": int(v[1])}
                          for c, v in sorted(cats.items(), key=lambda kv: -kv[1][0])}
    out["top_kernels"] = [{"name": n[:120], "s": round(v[0] / 1e6, 4), "calls": int(v[1]),
                           "avg_us": round(v[0] / v[1], 1), "category": category(n)}
                          for n, v in sorted(names.items(), key=lambda kv: -kv[1][0])[:top]]
    return out


def timeline_summary(events: list[DeviceEvent], marks: list[tuple[float, float]]) -> dict[str, Any]:
    """Phases of one traced block: `prefill` (the device's events up to the end of the first selection, which
    waited for the device: the host runs ahead, so a selection's start says nothing), `decode` (from there to
    the end of the last one), and `step_walls_s` (the seconds between consecutive selections' ends)."""
    if not events:
        return {}
    if not marks:
        return {"all": phase_summary(events, events[0].start_us, float("inf"))}
    out = {"prefill": phase_summary(events, events[0].start_us, marks[0][1]),
           "decode": phase_summary(events, marks[0][1], marks[-1][1])}
    out["step_walls_s"] = [round((b[1] - a[1]) / 1e6, 4) for a, b in zip(marks, marks[1:])]
    return out


def read_events(path: Path) -> tuple[list[DeviceEvent], list[tuple[float, float]]]:
    """`write_events`' file back as (events, marks)."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    names = data["names"]
    events = [DeviceEvent(names[n], stream, start, end) for n, stream, start, end in data["events"]]
    return events, [tuple(m) for m in data["marks"]]


def write_events(path: Path, events: list[DeviceEvent], marks: list[tuple[float, float]]) -> None:
    """The compact timeline as gzip JSON: {"marks": [[start, end] us], "names": [...], "events": [[name index,
    stream, start us, end us]]} (times relative to the first event)."""
    t0 = events[0].start_us if events else 0.0
    names: dict[str, int] = {}
    rows = [[names.setdefault(e.name, len(names)), e.stream, round(e.start_us - t0, 2), round(e.end_us - t0, 2)]
            for e in events]
    data = {"marks": [[round(a - t0, 2), round(b - t0, 2)] for a, b in marks], "names": list(names), "events": rows}
    with gzip.open(path, "wt") as f:
        json.dump(data, f)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Print the phases (`timeline_summary`) of a saved timeline as JSON."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path, help="a --trace-out file (gzip JSON)")
    args = ap.parse_args(argv)
    out = timeline_summary(*read_events(args.path))
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
