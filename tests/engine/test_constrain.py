"""Unit tests of constrained decoding, the block decoder, the tokenizer and chat templates, on the tiny
byte-level BPE tokenizer of helpers/tiny_tokenizer.py (trained offline, deterministic)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from engine.decoding.chat import ChatTemplateError, check_messages, messages_for, render_chat
from engine.decoding.constrain import GrammarConstraint, bitmask_to_bool, escape_regex, ll_tokenizer, unpack_bits
from engine.decoding.decoder import BlockDecoder, cut_at_stop
from engine.decoding.params import SamplingParams
from engine.decoding.tokenizer import Tokenizer
from helpers.tiny_tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def constraint(tok: Tokenizer, params: SamplingParams, rows: int) -> GrammarConstraint:
    return GrammarConstraint.for_params(params, tok.to_json(), tok.eos_token_ids, tok.vocab_size, rows)


def run_random(tok: Tokenizer, params: SamplingParams, rows: int = 8, max_new: int = 60, seed: int = 0):
    """Decode `rows` rows under params' constraint from random logits; return the completions."""
    gen = torch.Generator().manual_seed(seed)
    dec = BlockDecoder([[1]] * rows, [max_new] * rows, params, eos_ids=tok.eos_token_ids, tokenizer=tok,
                       constraint=constraint(tok, params, rows))
    alive = list(range(rows))
    while alive:
        logits = torch.randn(len(alive), tok.vocab_size, generator=gen) * 3
        _, finished = dec(alive, logits)
        alive = [r for r, f in zip(alive, finished) if not f]
    return dec.completions()


def test_tokenizer_roundtrip_bos_eos(tok):
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    ids = tok.encode("Invoice total: 12.50")
    assert ids[0] == 1 and tok.decode(ids) == "Invoice total: 12.50"
    assert tok.encode("x", add_special_tokens=False)[0] != 1
    assert tok.encode_batch(["a b", "order"]) == [tok.encode("a b"), tok.encode("order")]


def test_incremental_detokenizer_matches_full_decode(tok):
    text = 'The quick {"é": "ü"} fox 1,234.56'
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.detokenizer()
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) == detok.text == tok.decode(ids) == text


def test_chat_template_renders_and_validates():
    text = render_chat(CHAT_TEMPLATE, messages_for("hi", system="be brief"))
    assert text == "<s>system: be brief\n<s>user: hi\n<s>assistant:"
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        check_messages([{"role": "user", "content": "a"}, {"role": "user"}])
    with pytest.raises(ChatTemplateError, match="no system"):
        render_chat("{{ raise_exception('no system') }}", messages_for("x"))
    with pytest.raises(ChatTemplateError, match="Jinja"):
        render_chat("{% for %}", messages_for("x"))
    # the sandbox refuses attribute access to internals
    with pytest.raises(Exception):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", messages_for("x"))
    assert render_chat("{{ messages | tojson }}", messages_for("é")) == '[{"role": "user", "content": "é"}]'


def test_bitmask_to_bool():
    bitmask = np.array([[0b101, -1], [0, -(1 << 31)]], dtype=np.int32)
    allowed = bitmask_to_bool(bitmask, 70)
    assert allowed.shape == (2, 70)
    assert allowed[0, :3].tolist() == [True, False, True] and allowed[0, 32:64].all()
    assert not allowed[:, 64:].any()
    assert allowed[1].nonzero().flatten().tolist() == [63]
    assert bitmask_to_bool(bitmask, 40).shape == (2, 40)


def test_unpacking_the_packed_words_is_numpys_unpacking():
    """The device path (`unpack_bits` on the packed int32 words) gives numpy's bits, sign bit included."""
    words = np.random.default_rng(0).integers(-(1 << 31), 1 << 31, size=(5, 7), dtype=np.int64).astype(np.int32)
    assert torch.equal(unpack_bits(torch.from_numpy(words)), bitmask_to_bool(words, 7 * 32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bitmask_to_bool_on_cuda_unpacks_there():
    words = np.array([[0b101, -1], [0, -(1 << 31)]], dtype=np.int32)
    on_gpu = bitmask_to_bool(words, 70, "cuda")
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), bitmask_to_bool(words, 70))


def test_prefetched_masks_are_the_masks_computed_when_asked(tok):
    """`prefetch` computes rows' next masks ahead; `allowed` for exactly those rows returns them, for other rows
    it waits for any prefetch of theirs and computes afresh; a row's matcher is read or advanced only after
    its prefetch (`advance`, `is_accepting`), so the tokens fed are the same either way."""
    params = SamplingParams(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
    ahead, plain = constraint(tok, params, 6), constraint(tok, params, 6)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        rows = [0, 1, 2, 3, 4, 5] if step % 3 else [0, 2, 4]       # every third step asks for other rows
        a, b = ahead.allowed(rows, tok.vocab_size), plain.allowed(rows, tok.vocab_size)
        assert torch.equal(a, b)
        logits = torch.randn(len(rows), tok.vocab_size, generator=gen).masked_fill(~a, float("-inf"))
        for row, token in zip(rows, logits.argmax(-1).tolist()):
            assert ahead.advance(row, token, 20) == plain.advance(row, token, 20)
        ahead.prefetch(rows)
        assert [ahead.is_accepting(r) for r in rows] == [plain.is_accepting(r) for r in rows]
    ahead.settle(range(6))
    assert not ahead._ahead and not ahead._busy


def test_advance_rows_feeds_as_advance_row_by_row(tok):
    """`advance_rows` over a batch gives the tokens, completions and errors of `advance` row by row, budgets
    included (tight budgets make rows take tokens of their completion instead of the chosen ones); a rejected
    token is that row's error, not the batch's."""
    params = SamplingParams(json_schema={"type": "object", "properties": {"name": {"type": "string"},
                                                                          "n": {"type": "integer"}},
                                         "required": ["name", "n"]})
    rows = list(range(6))
    batched, single = constraint(tok, params, 6), constraint(tok, params, 6)
    gen = torch.Generator().manual_seed(3)
    alive, replaced, done = rows, 0, 0
    for step in range(24):
        allowed = single.allowed(alive, tok.vocab_size)
        assert torch.equal(batched.allowed(alive, tok.vocab_size), allowed)
        chosen = torch.randn(len(alive), tok.vocab_size, generator=gen).masked_fill(~allowed, float("-inf"))
        tokens = chosen.argmax(-1).tolist()
        remaining = [23 - step - r for r in range(len(alive))]               # row r has r fewer tokens left
        fed, complete, errors = batched.advance_rows(alive, tokens, remaining)
        assert errors == [None] * len(alive)
        assert list(zip(fed, complete)) == [single.advance(r, t, m) for r, t, m in zip(alive, tokens, remaining)]
        replaced += sum(a != b for a, b in zip(fed, tokens))
        done += sum(complete)
        alive = [r for r, c in zip(alive, complete) if not c]
        if not alive:
            break
    assert replaced > 0 and done == 6                  # the budgets bit, and every row closed its object
    fresh = constraint(tok, params, 2)
    brace = tok.encode("{", add_special_tokens=False)[0]
    fed, complete, errors = fresh.advance_rows([0, 1], [brace, tok.encode("x", add_special_tokens=False)[0]])
    assert fed[0] == brace and errors[0] is None and "rejected" in errors[1] and complete == [False, False]


def test_escape_regex_matches_literally():
    for s in ["a+b", "(x)", "1.5", "c|d", "what?", "[tag]", "50% off"]:
        assert re.fullmatch(escape_regex(s), s)


def test_ll_tokenizer_is_cached(tok):
    a = ll_tokenizer(tok.to_json(), tok.eos_token_ids, tok.vocab_size)
    assert ll_tokenizer(tok.to_json(), list(tok.eos_token_ids), tok.vocab_size) is a


def test_choices_always_valid(tok):
    choices = ("bug", "billing", "other", "a+b")
    for seed in range(3):
        outs = run_random(tok, SamplingParams(choices=choices), seed=seed)
        assert all(c.text in choices and c.finish_reason == "stop" for c in outs), [c.text for c in outs]


def test_regex_always_matches(tok):
    pattern = r"[0-9]{3}-[a-z]{2}"
    outs = run_random(tok, SamplingParams(regex=pattern))
    assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in outs), [c.text for c in outs]


def test_json_schema_always_parses(tok):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 4}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"}}, "required": ["name", "n", "ok"], "additionalProperties": False}
    outs = run_random(tok, SamplingParams(json_schema=schema), max_new=80)
    for c in outs:
        assert c.finish_reason == "stop", c
        value = json.loads(c.text)
        assert set(value) == {"name", "n", "ok"} and 0 <= value["n"] <= 99 and isinstance(value["ok"], bool)


def test_cut_generation_reports_length(tok):
    outs = run_random(tok, SamplingParams(regex=r"[a-z]{30}"), rows=2, max_new=3)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 3 for c in outs)


def test_invalid_regex_names_the_field(tok):
    with pytest.raises(ValueError, match="regex"):
        constraint(tok, SamplingParams(regex="(unclosed"), 1)
    with pytest.raises(ValueError, match="choices"):
        constraint(tok, SamplingParams(choices=()), 1)


def forced(token_rows: list[list[int]], vocab: int) -> list[torch.Tensor]:
    """One-hot logits per step that force each row's scripted tokens."""
    steps = max(len(r) for r in token_rows)
    out = []
    for t in range(steps):
        logits = torch.full((len(token_rows), vocab), -10.0)
        for i, r in enumerate(token_rows):
            logits[i, r[min(t, len(r) - 1)]] = 10.0
        out.append(logits)
    return out


def test_block_decoder_eos_stop_strings_and_length(tok):
    hello = tok.encode("hello STOP world", add_special_tokens=False)
    plain = tok.encode("order", add_special_tokens=False)
    scripts = [hello, plain + [2], hello]
    params = SamplingParams(stop=("STOP",), logprobs=True)
    dec = BlockDecoder([[1, 5], [1], [1, 7, 7]], [50, 50, 2], params, eos_ids={2}, tokenizer=tok)
    alive = [0, 1, 2]
    for logits in forced(scripts, tok.vocab_size):
        if not alive:
            break
        tokens, finished = dec(alive, logits[alive])
        alive = [r for r, f in zip(alive, finished) if not f]
    c0, c1, c2 = dec.completions()
    assert c0.text == "hello " and c0.finish_reason == "stop"
    assert c1.text == "order" and c1.finish_reason == "stop" and c1.token_ids == plain + [2]
    assert c2.finish_reason == "length" and len(c2.token_ids) == 2 and c2.prompt_tokens == 3
    assert len(c1.logprobs) == len(c1.token_ids) and all(lp <= 0 for lp in c1.logprobs)


def test_cut_at_stop_takes_earliest():
    assert cut_at_stop("a;b.c", [".", ";"]) == ("a", True)
    assert cut_at_stop("abc", ["x"]) == ("abc", False)


@pytest.mark.parametrize("version, parts", [("1.9.1", (1, 9, 1)), ("1.10.0rc1", (1, 10, 0)), ("2", (2,)),
                                            ("dev", ())])
def test_llguidance_versions_are_read_by_their_numbers(version, parts):
    from engine.decoding.constrain import _version_tuple
    assert _version_tuple(version) == parts


def test_an_llguidance_too_old_is_refused_with_the_version_found(monkeypatch):
    """llguidance 1.6.1's LLTokenizer takes one eos token, not the list the engine passes: it is refused at
    import with the version and the fix, not left to raise a TypeError inside a call."""
    import llguidance

    from engine.decoding import constrain
    monkeypatch.setattr(llguidance, "__version__", "1.6.1", raising=False)
    with pytest.raises(ImportError, match=r"llguidance >= 1\.9, found 1\.6\.1.*pip install -U"):
        constrain._llguidance()
    monkeypatch.setattr(llguidance, "__version__", "1.9.1", raising=False)
    assert constrain._llguidance() is llguidance


def test_next_masks_start_when_the_step_ends(tok):
    """The decoder starts a GPU batch's next masks at `end_step`, not at its own choice, so no mask is computed
    beside another batch's advance; every batch then finds its masks computed ahead, and the tokens are those of
    a decoder whose masks are all computed on demand."""
    params = SamplingParams(json_schema={"type": "object", "properties": {"a": {"type": "integer"},
                                                                          "b": {"type": "string"}}})
    batches, rows = [[0, 1, 2], [3, 4, 5]], 6
    dec = BlockDecoder([[1]] * rows, [30] * rows, params, eos_ids=tok.eos_token_ids, tokenizer=tok,
                       constraint=constraint(tok, params, rows))
    ref = BlockDecoder([[1]] * rows, [30] * rows, params, eos_ids=tok.eos_token_ids, tokenizer=tok,
                       constraint=constraint(tok, params, rows))
    gen = torch.Generator().manual_seed(5)
    ahead_found = 0
    for step in range(30):
        for k, live in enumerate(batches):
            if not live:
                continue
            if step:
                assert tuple(live) in dec.constraint._ahead      # started at the last end_step
                ahead_found += 1
            logits = torch.randn(len(live), tok.vocab_size, generator=gen) * 3
            before = set(dec.constraint._ahead)
            tokens, finished = dec(live, logits)
            assert (tokens, finished) == ref(live, logits)
            assert set(dec.constraint._ahead) == before - {tuple(live)}     # nothing starts before the step ends
            batches[k] = [r for r, f in zip(live, finished) if not f]
        dec.end_step()
        ref.constraint.settle(range(rows))
    assert ahead_found > 10 and not any(batches)
    assert [c.text for c in dec.completions()] == [c.text for c in ref.completions()]
