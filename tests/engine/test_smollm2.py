"""The facade on the embedded SmolLM2-135M-Instruct: greedy text equals transformers' on chat prompts;
constrained outputs always parse; stop strings cut the text. One module-scoped LLM (float32 for parity)."""
from __future__ import annotations

import json
import re

import pytest
import torch

from helpers.skips import requires_smollm2, smollm2_gguf_path
from engine import LLM, SamplingParams

pytestmark = [requires_smollm2, pytest.mark.slow]

PROMPTS = [
    "What is the capital of France?",
    "Classify the sentiment of this review as positive or negative: The delivery was late and the box was crushed.",
    "Extract the city from this address: 221B Baker Street, London NW1 6XE, United Kingdom",
    "Write one sentence about invoices.",
    "Summarize: Customer reports that the login page returns error 500 after the latest update.",
    "Translate to French: Good morning",
    "List three fruits.",
    "Order #A-1029 for 3 widgets at $4.50 each. What is the total?",
]


@pytest.fixture(scope="module")
def llm():
    with LLM("smollm2-135m-instruct", dtype="float32", device="cpu") as model:
        yield model


@pytest.fixture(scope="module")
def hf(llm):
    """transformers' model (its own GGUF loader) and tokenizer (our conversion's tokenizer.json)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    folder, gguf = llm.loaded.tokenizer_dir, smollm2_gguf_path()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token=llm.tokenizer.bos_token,
                                  eos_token=llm.tokenizer.eos_token)
    tok.chat_template = llm.tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    return model, tok


def test_greedy_text_equals_transformers(llm, hf):
    model, tok = hf
    out = llm.generate(PROMPTS, SamplingParams(max_new_tokens=24))
    prompt_ids = []
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True)
        prompt_ids.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    width = max(map(len, prompt_ids))
    pad = tok.eos_token_id
    batch = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])                 # [b, s] left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])         # [b, s]
    with torch.no_grad():
        new = model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=24, do_sample=False,
                             pad_token_id=pad)[:, width:].tolist()
    for prompt, ids, c, seq in zip(PROMPTS, prompt_ids, out, new):
        if pad in seq:  # transformers pads a finished row; the EOS itself is the first pad id
            seq = seq[: seq.index(pad) + 1]
        assert c.prompt_tokens == len(ids), prompt
        assert c.token_ids == seq, prompt
        assert c.text == tok.decode(seq, skip_special_tokens=True), prompt
        assert c.finish_reason == ("stop" if seq[-1] in llm.eos_token_ids else "length")


def test_choices_always_valid(llm):
    choices = ("bug", "billing", "other")
    tickets = ["The app crashes when I click save.", "I was charged twice this month.",
               "Do you have an office in Berlin?", "Refund my last invoice please.",
               "Error 500 on the login page.", "What are your opening hours?"]
    out = llm.generate([f"Classify this ticket as bug, billing or other: {t}" for t in tickets],
                       SamplingParams(max_new_tokens=8, choices=choices))
    assert all(c.text in choices and c.finish_reason == "stop" for c in out), [c.text for c in out]


def test_json_schema_always_parses(llm):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
              "required": ["city", "zip"], "additionalProperties": False}
    addresses = ["221B Baker Street, London NW1 6XE", "1600 Amphitheatre Pkwy, Mountain View, CA 94043",
                 "10 Downing Street, London SW1A 2AA", "350 Fifth Avenue, New York, NY 10118"]
    out = llm.generate([f"Extract the city and zip code as JSON from: {a}" for a in addresses],
                       SamplingParams(max_new_tokens=48, json_schema=schema))
    for c in out:
        assert c.finish_reason == "stop", c
        value = json.loads(c.text)
        assert set(value) == {"city", "zip"} and all(isinstance(v, str) for v in value.values())


def test_regex_always_matches(llm):
    pattern = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    out = llm.generate(["When did the French revolution start? Answer with a date.",
                        "Write today's date.", "Give a date in 1999."],
                       SamplingParams(max_new_tokens=16, regex=pattern))
    assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in out), [c.text for c in out]


def test_stop_strings_cut_the_text(llm):
    prompt = ["List three fruits, one per line."]
    full = llm.generate(prompt, SamplingParams(max_new_tokens=32))[0]
    assert "\n" in full.text, full.text
    cut = llm.generate(prompt, SamplingParams(max_new_tokens=32, stop=("\n",)))[0]
    assert cut.finish_reason == "stop" and "\n" not in cut.text
    assert cut.text == full.text[: full.text.index("\n")]
    assert len(cut.token_ids) < len(full.token_ids)
