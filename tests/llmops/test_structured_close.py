"""Structured output always closes: a constrained row keeps enough of its max_new_tokens to complete its
grammar (engine/closing.py, `GrammarConstraint.advance`), and the operator's meta columns keep the raw text
and say why a row's output is null.

Rambling models are the case: random logits (scaled up, so nothing ever closes by itself) on the tiny
trained tokenizer, and a tiny random Llama behind the facade.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pytest
import torch

from engine import LLM, Policy
from engine.decoding.closing import ClosingTokens, closing_path, hints_after
from engine.decoding.constrain import GrammarConstraint
from engine.decoding.decoder import BlockDecoder
from engine.decoding.params import Completion, SamplingParams
from engine.decoding.tokenizer import Tokenizer
from helpers.fake_engine import FakeLLM
from llmops.core import MapSpec, map_table_ordered
from helpers.tiny_tokenizer import build_tiny_tokenizer

FLAT = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
        "required": ["name", "city"], "additionalProperties": False}
ITEM = {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
                                         "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["sku", "qty", "tags"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM}, "total": {"type": "number"},
                                           "paid": {"type": "boolean"}},
          "required": ["items", "total", "paid"], "additionalProperties": False}
LOOSE = {"type": "object",  # no additionalProperties: false, like a pydantic model's schema
         "properties": {"a": {"type": "string"}, "b": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
         "required": ["a", "b"]}

PATTERNED = {"type": "object",  # patterns and an enum, like pipelines/extract_invoices.yaml's schema
             "properties": {"amount": {"type": "string", "pattern": "^[0-9][0-9,]*(\\.[0-9]{1,2})?$"},
                            "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
                            "due": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
             "required": ["amount", "currency", "due"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def constraint(tok: Tokenizer, params: SamplingParams, rows: int) -> GrammarConstraint:
    return GrammarConstraint.for_params(params, tok.to_json(), tok.eos_token_ids, tok.vocab_size, rows)


def shortest(tok: Tokenizer, params: SamplingParams) -> int:
    """Tokens of the closing search's completion from the grammar's start (what a row needs at least)."""
    con = constraint(tok, params, 1)
    path = closing_path(con._matchers[0], con._tokenizer, ClosingTokens.for_tokenizer(con._tokenizer), 1000)
    assert path is not None
    return len(path)


def run_random(tok: Tokenizer, params: SamplingParams, max_new: int, rows: int = 8, seed: int = 0,
               scale: float = 6.0) -> list[Completion]:
    """Decode `rows` rows from random logits under params' constraint and budget."""
    gen = torch.Generator().manual_seed(seed)
    dec = BlockDecoder([[1]] * rows, [max_new] * rows, params, eos_ids=tok.eos_token_ids, tokenizer=tok,
                       keys=list(range(rows)), constraint=constraint(tok, params, rows))
    alive = list(range(rows))
    while alive:
        logits = torch.randn(len(alive), tok.vocab_size, generator=gen) * scale
        logits[:, list(tok.eos_token_ids)] = -50.0  # never ends by itself
        _, finished = dec(alive, logits)
        alive = [r for r, f in zip(alive, finished) if not f]
    return dec.completions()


def scripted(tok: Tokenizer, params: SamplingParams, text: str, max_new: int) -> Completion:
    """Decode one row whose logits always favour the next token of `text` (then EOS)."""
    script = tok.encode(text, add_special_tokens=False) + [tok.eos_token_ids[0]]
    dec = BlockDecoder([[1]], [max_new], params, eos_ids=tok.eos_token_ids, tokenizer=tok,
                       constraint=constraint(tok, params, 1))
    for step in range(max_new):
        logits = torch.zeros(1, tok.vocab_size)
        logits[0, script[min(step, len(script) - 1)]] = 20.0
        if dec([0], logits)[1][0]:
            break
    return dec.completions()[0]


@pytest.mark.parametrize("schema", [FLAT, NESTED, LOOSE, PATTERNED], ids=["flat", "nested", "loose", "patterned"])
def test_json_closes_inside_a_tight_budget(tok, schema):
    need = shortest(tok, SamplingParams(json_schema=schema))
    for extra, temperature in [(0, 0.0), (3, 0.0), (12, 1.0)]:
        params = SamplingParams(json_schema=schema, max_new_tokens=need + extra, temperature=temperature)
        for seed in range(2):
            for c in run_random(tok, params, need + extra, seed=seed):
                assert c.finish_reason == "stop" and len(c.token_ids) <= need + extra, c
                assert set(json.loads(c.text)) == set(schema["properties"]), c.text


def test_nested_schema_closes_after_opening_items(tok):
    """The reserve follows the structure: a row that opened an array item keeps room for its required
    fields and the outer object's; with one token less it has to close earlier."""
    params = SamplingParams(json_schema=NESTED)
    text = '{"items": [{"sku": "a", "qty": 1, "tags": ["x"]}, {"sku": "bb'
    ids = tok.encode(text, add_special_tokens=False)
    con = constraint(tok, params, 1)
    assert con._matchers[0].consume_tokens(ids)
    need = len(closing_path(con._matchers[0], con._tokenizer, ClosingTokens.for_tokenizer(con._tokenizer), 1000))
    assert need > 20  # '", "qty": 0, "tags": []}], "total": 0, "paid": false}' in this small vocab
    c = scripted(tok, params, text, len(ids) + need)
    value = json.loads(c.text)
    assert c.finish_reason == "stop" and len(value["items"]) == 2 and value["items"][1]["sku"].startswith("bb")
    assert value["items"][1]["qty"] == 0 and value["items"][1]["tags"] == []
    short = scripted(tok, params, text, len(ids) + need - 1)
    assert short.finish_reason == "stop" and json.loads(short.text)["items"][1]["sku"] != "bb"


def test_ample_budget_changes_nothing(tok):
    text = '{"name": "Ada", "city": "London"}'
    params = SamplingParams(json_schema=FLAT)
    c = scripted(tok, params, text, 64)
    assert c.text == text and c.finish_reason == "stop"
    long = '{"name": "Ada Lovelace of London and the Analytical Engine", "city": "London"}'
    cut = scripted(tok, SamplingParams(json_schema=FLAT, logprobs=True), long, shortest(tok, params) + 4)
    assert cut.finish_reason == "stop" and json.loads(cut.text)["name"].startswith("Ada")
    assert len(cut.logprobs) == len(cut.token_ids) and all(-1e4 < lp <= 0 for lp in cut.logprobs)


def test_regex_and_choices_close(tok):
    pattern = r"[a-z]+@[a-z]+\.com"
    params = SamplingParams(regex=pattern)
    need = shortest(tok, params)
    for c in run_random(tok, params, need + 2):
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), c
    choices = ("bug", "billing", "other")
    params = SamplingParams(choices=choices)
    for c in run_random(tok, params, shortest(tok, params)):
        assert c.finish_reason == "stop" and c.text in choices, c


def test_complete_match_at_the_limit_is_stop(tok):
    c = scripted(tok, SamplingParams(regex=r"[0-9]+"), "1234567", 3)
    assert c.finish_reason == "stop" and c.text.isdigit() and len(c.token_ids) == 3


def test_budget_below_any_completion_is_left_alone(tok):
    params = SamplingParams(json_schema=NESTED)
    need = shortest(tok, params)
    outs = run_random(tok, params, need - 1, rows=2)
    assert all(c.finish_reason == "length" and len(c.token_ids) == need - 1 for c in outs)


def test_closing_is_deterministic(tok):
    params = SamplingParams(json_schema=NESTED, temperature=0.8)
    need = shortest(tok, params)
    first = run_random(tok, params, need + 5, seed=3)
    again = run_random(tok, params, need + 5, seed=3)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama):
    """The engine on the tiny Llama (CPU, fp32, blocks of 4 rows)."""
    with LLM(tiny_llama, dtype="float32", device="cpu", policy=Policy(gpu_batch_size=4, num_gpu_batches=1)) as llm:
        yield llm


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_random_llama_json_always_closes(tiny_llm, tok, temperature):
    budget = shortest(tok, SamplingParams(json_schema=FLAT)) + 4
    prompts = [f"Extract the name and city from record {i}: Ada, London" for i in range(6)]
    out = tiny_llm.generate(prompts, SamplingParams(max_new_tokens=budget, json_schema=FLAT,
                                                    temperature=temperature, chat=False))
    for c in out:
        assert c.finish_reason == "stop" and len(c.token_ids) <= budget, c
        assert set(json.loads(c.text)) == {"name", "city"}, c.text


class _BadJsonLLM:
    """An engine whose structured rows finish "stop" with text that is not JSON."""

    def generate(self, prompts: list, params: SamplingParams | None = None) -> list[Completion]:
        return [Completion('{"n": oops', [1, 2, 3], "stop", 4) for _ in prompts]


def test_meta_keeps_text_and_says_why_output_is_null():
    table = pa.table({"body": ["fine", "CUT here", None]})
    spec = MapSpec(template="{body}", schema={"n": "integer"})
    out = map_table_ordered(table, spec, engine=FakeLLM(), cache_dir=False).to_pylist()
    good, cut, null = out
    assert good["output"] is not None and good["error"] is None and json.loads(good["text"])["n"] == good["output"]["n"]
    assert cut["output"] is None and cut["finish_reason"] == "length"
    assert cut["error"] == "output cut by max_new_tokens=64 before the JSON was complete"
    assert cut["text"] and cut["text"].startswith('{"n"')
    assert null["text"] is None and null["error"] is None and null["finish_reason"] is None
    bad = map_table_ordered(pa.table({"body": ["x"]}), spec, engine=_BadJsonLLM(), cache_dir=False).to_pylist()[0]
    assert bad["output"] is None and bad["finish_reason"] == "error" and bad["text"] == '{"n": oops'
    assert bad["error"].startswith("unparsable structured output: output is not valid JSON")


def test_polars_meta_has_the_text():
    import polars as pl

    import llmops

    df = pl.DataFrame({"body": ["fine", "CUT here"]})
    out = df.with_columns(llmops.llm_map("{body}", schema={"n": pl.Int64}, engine=FakeLLM(), cache_dir=False,
                                         with_meta=True).alias("m"))
    m = out["m"].struct.unnest()
    assert m.columns == ["output", "finish_reason", "error", "text", "prompt_tokens", "completion_tokens",
                         "confidence", "model"]
    assert m["error"].to_list()[0] is None and "max_new_tokens=64" in m["error"].to_list()[1]
    assert all(t.startswith('{"n"') for t in m["text"].to_list())


def test_hinted_search_reuses_the_old_closing(tok):
    """After a token that replaced, began or needs one token before the row's closing, the search ends with
    the old closing's tail: the same completion the full walk finds, in one validate or one step."""
    con = constraint(tok, SamplingParams(json_schema=PATTERNED), 1)
    matcher, ll = con._matchers[0], con._tokenizer
    probes = ClosingTokens.for_tokenizer(ll)
    assert matcher.consume_tokens(tok.encode('{"amount": "12', add_special_tokens=False))
    closing = closing_path(matcher, ll, probes, 1000)
    assert closing is not None and ll.decode_bytes(closing).startswith(b'"')
    for text in [".", ".5", '"']:      # needs a digit first; a digit took the closing's place; begins it
        ids = tok.encode(text, add_special_tokens=False)
        work = matcher.deep_copy()
        assert work.consume_tokens(ids)
        hints = hints_after(ll, closing, ids[-1]) if len(ids) == 1 else [closing]
        hinted = closing_path(work, ll, probes, 1000, hints)
        full = closing_path(work, ll, probes, 1000)
        assert hinted is not None and full is not None and len(hinted) <= len(full), text
        assert work.validate_tokens([*hinted, probes.eos]) == len(hinted) + 1
        done = json.loads((b'{"amount": "12' + ll.decode_bytes(ids + hinted)).decode())
        assert done["amount"].startswith("12" + text.strip('"')) and set(done) == set(PATTERNED["properties"])


@pytest.mark.parametrize("schema", [NESTED, PATTERNED], ids=["nested", "patterned"])
def test_hinted_closings_are_valid_and_never_longer(tok, schema):
    """Along random constrained walks, the closing each step keeps (from the previous step's hints)
    completes the grammar and is no longer than a fresh search from the same state."""
    params = SamplingParams(json_schema=schema)
    con = constraint(tok, params, 1)
    matcher, ll = con._matchers[0], con._tokenizer
    probes = ClosingTokens.for_tokenizer(ll)
    gen = torch.Generator().manual_seed(5)
    closing = closing_path(matcher, ll, probes, 1000)
    steps = 0
    while closing and steps < 60:
        allowed = con.allowed([0], tok.vocab_size)[0].nonzero().flatten().tolist()
        choices = [t for t in allowed if t not in tok.eos_token_ids]
        token = choices[int(torch.randint(len(choices), (1,), generator=gen))]
        assert matcher.consume_token(token)
        hinted = closing_path(matcher, ll, probes, 1000, hints_after(ll, closing, token))
        full = closing_path(matcher, ll, probes, 1000)
        assert hinted is not None and (full is None or len(hinted) <= len(full))  # None: the walk dead-ends
        assert matcher.validate_tokens([*hinted, probes.eos]) == len(hinted) + 1 if hinted else matcher.is_accepting()
        closing, steps = hinted, steps + 1
    assert steps >= 10



def test_rows_at_the_start_share_one_closing_search(tok):
    """Every row of a block begins in the grammar's start state: the completion kept for its first budgeted
    token is searched once per budget and is the one a search on that row finds; a row fed tokens before its
    first budgeted one gets a search of its own state."""
    params = SamplingParams(json_schema=FLAT)
    con, need = constraint(tok, params, 3), shortest(tok, params)
    probes = ClosingTokens.for_tokenizer(con._tokenizer)
    alone = closing_path(constraint(tok, params, 1)._matchers[0], con._tokenizer, probes, need + 5)
    opening = tok.encode('{"name": "Al', add_special_tokens=False)
    for token in opening:
        con.advance(2, token)
    after_opening = closing_path(con._matchers[2], con._tokenizer, probes, need + 5)
    assert after_opening is not None and after_opening != alone
    assert [con._first_closing(row, need + 5) for row in range(3)] == [alone, alone, after_opening]
    assert list(con._start_closings) == [need + 5] and con._start_closings[need + 5] == alone


class _MaskOnly:
    """A matcher stand-in for `_mask_token`: a fixed bitmask; the grammar accepts after `accepting` tokens."""

    def __init__(self, words: np.ndarray, accepting: set[int]) -> None:
        self.words, self.accepting = words, accepting

    def compute_bitmask(self) -> bytes:
        return self.words.astype("<u4").tobytes()

    def validate_tokens(self, tokens: list[int]) -> int:
        return len(tokens) if tokens[0] in self.accepting else 1


@pytest.mark.parametrize("seed", range(4))
def test_mask_token_reads_the_lowest_allowed_tokens_as_the_whole_mask_does(seed):
    """Unpacking only the mask's first non-zero words gives the token a scan of every bit gives: the lowest
    allowed token (EOS skipped) after which the grammar accepts, else the lowest allowed one."""
    from engine.decoding.closing import _SCAN, _mask_token

    rng = np.random.default_rng(seed)
    words = np.zeros(1536, dtype=np.uint32)
    hot = rng.choice(1536, size=300, replace=False)
    words[hot] = rng.integers(1, 1 << 32, size=300, dtype=np.uint64).astype(np.uint32)
    every = np.flatnonzero(np.unpackbits(words.astype("<u4").view(np.uint8), bitorder="little"))
    eos = int(every[3])
    scanned = [t for t in every.tolist() if t != eos][:_SCAN]
    accepting = {scanned[-1], int(every[-1])}                 # one inside the scanned window, one past it
    assert _mask_token(_MaskOnly(words, accepting), eos) == scanned[-1]
    assert _mask_token(_MaskOnly(words, {int(every[-1])}), eos) == scanned[0]


def test_hints_only_search_skips_the_walk(tok):
    """walk=False tries the hints and nothing else: None where only the grammar walk finds a completion, the
    hint where one completes the grammar in time."""
    con = constraint(tok, SamplingParams(json_schema=FLAT), 1)
    matcher, ll = con._matchers[0], con._tokenizer
    probes = ClosingTokens.for_tokenizer(ll)
    assert matcher.consume_tokens(tok.encode('{"name": "Al', add_special_tokens=False))
    closing = closing_path(matcher, ll, probes, 1000)
    assert closing is not None and closing_path(matcher, ll, probes, 1000, walk=False) is None
    assert closing_path(matcher, ll, probes, 1000, [closing], walk=False) == closing
    assert closing_path(matcher, ll, probes, len(closing) - 1, [closing], walk=False) is None


def test_a_row_with_room_keeps_its_closing_and_one_at_its_reserve_follows_it(tok):
    """Far from its budget, a token inside a free string leaves the kept completion as it was (one validate,
    no search); at its reserve, a token after which no hint completes the grammar in time is replaced by the
    completion's next token."""
    params = SamplingParams(json_schema=FLAT)
    con = constraint(tok, params, 2)
    opening = tok.encode('{"name": "Al', add_special_tokens=False)
    letter = tok.encode("x", add_special_tokens=False)
    assert len(letter) == 1
    for row in range(2):
        for token in opening:
            con.advance(row, token, 100)
    kept = con._closings[0]
    assert kept and tok.decode(kept).startswith('"')
    assert con.advance(0, letter[0], 50) == (letter[0], False) and con._closings[0] is kept
    tight = len(con._closings[1]) - 1               # tokens left after this one: one fewer than the closing
    fed, complete = con.advance(1, letter[0], tight)
    assert fed == kept[0] and con._closings[1] == kept[1:] and not complete
