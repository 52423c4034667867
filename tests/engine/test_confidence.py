"""`Completion.confidence` of constrained outputs (engine.decoding.confidence): folded in the decode loop, checked
against references built from the logits (the decoder's own logits and masks, and transformers' logits with the masks
of a fresh grammar fed the same tokens)."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from engine import LLM, Policy, SamplingParams
from engine.decoding.constrain import GrammarConstraint
from engine.decoding.decoder import BlockDecoder
from engine.decoding.tokenizer import Tokenizer
from helpers.tiny_tokenizer import build_tiny_tokenizer

CHOICES = ("bug", "bill", "billing", "other")   # "bill" is a prefix of "billing": EOS is a decision there
PATTERN = r"[0-9]{2,3}-[a-z]{2}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [40, 41], [100, 7, 3, 250, 31]]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


class RecordingConstraint:
    """A GrammarConstraint that keeps every mask it hands out, per row, in order."""

    def __init__(self, inner: GrammarConstraint) -> None:
        self.inner, self.masks = inner, {}

    def allowed(self, rows, vocab, device="cpu"):
        mask = self.inner.allowed(rows, vocab, device)
        for i, row in enumerate(rows):
            self.masks.setdefault(row, []).append(mask[i].clone())
        return mask

    def __getattr__(self, name):
        return getattr(self.inner, name)


def decode_random(tok: Tokenizer, params: SamplingParams, rows: int = 6, max_new: int = 40):
    """Decode `rows` rows from seeded random logits; return (completions, logits per row, masks per row)."""
    inner = GrammarConstraint.for_params(params, tok.to_json(), tok.eos_token_ids, tok.vocab_size, rows)
    constraint = RecordingConstraint(inner)
    keys = list(range(1, rows + 1)) if params.temperature > 0 else None
    dec = BlockDecoder([[1]] * rows, [max_new] * rows, params, eos_ids=tok.eos_token_ids, tokenizer=tok,
                       keys=keys, constraint=constraint)
    gen = torch.Generator().manual_seed(0)
    seen: dict[int, list[torch.Tensor]] = {r: [] for r in range(rows)}
    alive = list(range(rows))
    while alive:
        logits = torch.randn(len(alive), tok.vocab_size, generator=gen) * 3       # [n, v]
        for i, row in enumerate(alive):
            seen[row].append(logits[i].clone())
        _, finished = dec(alive, logits)
        alive = [r for r, f in zip(alive, finished) if not f]
    return dec.completions(), seen, constraint.masks


def masked_logprobs(logits: list[torch.Tensor], masks: list[torch.Tensor], tokens: list[int]) -> list[float]:
    """log q_t per step: log_softmax of the logits over the allowed tokens at temperature 1."""
    return [torch.log_softmax(lg.masked_fill(~m, float("-inf")), -1)[t].item()
            for lg, m, t in zip(logits, masks, tokens)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_choices_confidence_is_the_product_of_masked_probabilities(tok, temperature):
    params = SamplingParams(choices=CHOICES, temperature=temperature, top_k=5)
    outs, logits, masks = decode_random(tok, params)
    for row, c in enumerate(outs):
        assert c.text in CHOICES and c.finish_reason == "stop"
        expected = math.exp(sum(masked_logprobs(logits[row], masks[row], c.token_ids)))
        assert c.confidence == pytest.approx(expected, rel=1e-5), (row, c.text)
        assert 0 < c.confidence <= 1


@pytest.mark.parametrize("params", [SamplingParams(regex=PATTERN), SamplingParams(json_schema=SCHEMA)],
                         ids=["regex", "json_schema"])
def test_regex_and_schema_confidence_is_the_least_sure_token(tok, params):
    outs, logits, masks = decode_random(tok, params, max_new=60)
    for row, c in enumerate(outs):
        assert c.finish_reason == "stop", c
        per_token = masked_logprobs(logits[row], masks[row], c.token_ids)
        assert c.confidence == pytest.approx(math.exp(min(per_token)), rel=1e-5)
        forced = [lp for lp, m in zip(per_token, masks[row]) if int(m.sum()) == 1]
        assert all(lp == pytest.approx(0.0, abs=1e-6) for lp in forced)    # a forced token is certain
    if params.json_schema is not None:
        assert all(set(json.loads(c.text)) == {"name", "n"} for c in outs)


def test_no_confidence_without_a_constraint_or_a_finished_one(tok):
    dec = BlockDecoder([[1]] * 2, [4, 4], SamplingParams(), eos_ids=tok.eos_token_ids, tokenizer=tok)
    dec([0, 1], torch.randn(2, tok.vocab_size))
    assert all(c.confidence is None for c in dec.completions())
    cut, _, _ = decode_random(tok, SamplingParams(regex=r"[a-z]{30}"), rows=2, max_new=3)
    assert all(c.finish_reason == "length" and c.confidence is None for c in cut)


# ---- end to end on a tiny random Llama, against transformers' logits for the same tokens

def _reference(folder, params: SamplingParams, prompt: list[int], tokens: list[int], fold) -> float:
    """The confidence of `tokens` after `prompt`: transformers' logits for those tokens, masked by a fresh
    grammar fed the same tokens, folded with `fold`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = Tokenizer.from_dir(folder)
    grammar = GrammarConstraint.for_params(params, tok.to_json(), tok.eos_token_ids, tok.vocab_size, 1)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]     # [len(tokens), v]
    acc = 0.0
    for t, token in enumerate(tokens):
        mask = grammar.allowed([0], logits.shape[-1])[0]                                   # [v]
        acc = fold(acc, torch.log_softmax(logits[t].masked_fill(~mask, float("-inf")), -1)[token].item())
        grammar.advance(0, token)
    return math.exp(acc)


def _generate(folder, params: SamplingParams):
    with LLM(folder, dtype="float32", device="cpu", policy=Policy(gpu_batch_size=2, num_gpu_batches=1)) as llm:
        return llm.generate(PROMPTS, params)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_choices_confidence_matches_transformers(tiny_llama, temperature):
    params = SamplingParams(max_new_tokens=12, choices=CHOICES, temperature=temperature)
    for prompt, c in zip(PROMPTS, _generate(tiny_llama, params)):
        assert c.text in CHOICES and c.finish_reason == "stop"
        expected = _reference(tiny_llama, params, prompt, c.token_ids, lambda acc, lp: acc + lp)
        assert c.confidence == pytest.approx(expected, rel=1e-4), c.text


def test_regex_confidence_matches_transformers(tiny_llama):
    params = SamplingParams(max_new_tokens=12, regex=PATTERN)
    for prompt, c in zip(PROMPTS, _generate(tiny_llama, params)):
        assert re.fullmatch(PATTERN, c.text) and c.finish_reason == "stop"
        assert c.confidence == pytest.approx(_reference(tiny_llama, params, prompt, c.token_ids, min), rel=1e-4)
