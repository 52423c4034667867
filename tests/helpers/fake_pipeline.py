"""A small pipeline run on the fake engine, for tests of what a run reports."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from helpers.fake_engine import FakeLLM
from llmops.pipeline.load import load_pipeline
from llmops.pipeline.runner import run_pipeline


def fake_engine_report(tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    """A pipeline of 4 rows (one cut by max_new_tokens, one empty) on the fake engine: (RunResult, its report)."""
    data = tmp_path / "in.csv"
    data.write_text("id,body\n1,hello\n2,CUT here\n3,\n4,more\n")
    pipe = tmp_path / "p.yaml"
    pipe.write_text(f"cache_dir: false\nsource:\n  csv: {data}\nsteps:\n  - llm_map:\n      output: o\n"
                    f"      template: '{{body}}'\n      schema: {{n: integer}}\n"
                    f"sink:\n  parquet: {tmp_path / 'out.parquet'}\n")
    result = run_pipeline(load_pipeline(pipe), engine=FakeLLM(block_size=2))
    return result, json.loads((tmp_path / "out.parquet.report.json").read_text())
