"""Host cost of the grammar's budget bookkeeping: `GrammarConstraint.advance_rows` (feed each row's token, keep
a completion that fits the row's remaining tokens) timed over one `llmops run` of a JSON-schema pipeline on the
embedded model, in process. One record (common fields, advance_calls: row-tokens fed, advance_s,
advance_us_per_call: per row-token, run seconds; workload the pipeline's name) appended to
benchmarks/records/<machine>/grammar_advance.jsonl (or --out).

    python benchmarks/operators/grammar_advance.py [--pipeline pipelines/extract_invoices.yaml] [--limit 80]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import ROOT, Timer, add_record_args, new_record, save_record  # noqa: E402

from click.testing import CliRunner  # noqa: E402

from engine.decoding.constrain import GrammarConstraint  # noqa: E402
from llmops.cli import main as cli_main  # noqa: E402


def timed_run(argv: list[str]) -> tuple[int, float, float]:
    """(row-tokens fed, seconds inside `advance_rows`, wall seconds) of `llmops <argv>` in process."""
    spent, calls = [0.0], [0]
    advance = GrammarConstraint.advance_rows

    def timed(self: GrammarConstraint, rows, *args, **kwargs):
        began = time.perf_counter()
        try:
            return advance(self, rows, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - began
            calls[0] += len(rows)

    GrammarConstraint.advance_rows = timed
    try:
        with Timer() as clock:
            result = CliRunner().invoke(cli_main, argv, catch_exceptions=False)
    finally:
        GrammarConstraint.advance_rows = advance
    if result.exit_code != 0:
        raise SystemExit(f"llmops {' '.join(argv)} failed ({result.exit_code}): {result.output[-2000:]}")
    return calls[0], spent[0], clock.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", type=Path, default=ROOT / "pipelines" / "extract_invoices.yaml")
    ap.add_argument("--limit", type=int, default=80, help="source rows")
    add_record_args(ap)
    args = ap.parse_args()
    workload = args.pipeline.stem
    record = new_record("grammar_advance", workload, "smollm2-135m-instruct", commit=args.commit)
    argv = ["run", str(args.pipeline), "--limit", str(args.limit), "--no-cache", "--allow-errors", "--no-progress"]
    calls, spent, wall = timed_run(argv)
    record.update(rows=args.limit, advance_calls=calls, advance_s=round(spent, 4),
                  advance_us_per_call=round(1e6 * spent / max(calls, 1), 1), seconds=round(wall, 1),
                  llmops_argv=argv)
    save_record(record, args.out)


if __name__ == "__main__":
    main()
