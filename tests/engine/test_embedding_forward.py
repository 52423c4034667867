"""`LLM.embed`: unit-length mean-pooled embeddings from a forward pass, equal to transformers' hidden states pooled
the same way, independent of the batch a text shares (left padding is masked), with per-text errors."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, Policy
from engine.decoding.tokenizer import Tokenizer
from engine.runtime.embed import BATCH_TOKENS, pool

TEXTS = ["hello world", "a much longer text about the weather and the sea and the wind", "hello world", "x"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, dtype="float32", device="cpu", policy=Policy(gpu_batch_size=2, num_gpu_batches=1)) as m:
        yield m


def test_vectors_are_unit_length_and_equal_for_equal_texts(llm):
    out = llm.embed(TEXTS)
    vectors = torch.tensor([e.vector for e in out])                                  # [4, h]
    assert vectors.shape == (4, llm.config.hidden_size)
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(4), atol=1e-5)
    assert torch.equal(vectors[0], vectors[2]) and all(e.error is None and e.tokens > 0 for e in out)


def test_a_text_embeds_the_same_alone_and_in_a_padded_batch(llm):
    together = torch.tensor([e.vector for e in llm.embed(TEXTS)])
    alone = torch.tensor([llm.embed([t])[0].vector for t in TEXTS])
    assert torch.allclose(together, alone, atol=1e-5)


def test_matches_transformers_hidden_states_pooled_the_same_way(llm, tiny_llama):
    from transformers import AutoModelForCausalLM   # transformers: the reference implementation (tests only)

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = Tokenizer.from_dir(tiny_llama)
    for text, got in zip(TEXTS, llm.embed(TEXTS)):
        ids = torch.tensor([tok.encode(text)])
        with torch.no_grad():
            last = model(ids, output_hidden_states=True).hidden_states[-1]           # [1, s, h], after the final norm
        unnormed = last / model.model.norm.weight                                   # the final norm without its gain
        expected = pool(unnormed, torch.ones(ids.shape, dtype=torch.bool))[0]
        assert torch.allclose(torch.tensor(got.vector), expected, atol=1e-4)


def test_per_text_errors_and_no_generation(llm):
    out = llm.embed(["", "ok", "word " * 300])
    assert out[0].vector is None and out[0].error == "empty text"
    assert out[1].vector is not None
    assert out[2].vector is None and "exceeds the context" in out[2].error
    with pytest.raises(TypeError, match="list of strings"):
        llm.embed("not a list")


def test_many_texts_run_in_batches(llm):
    texts = [f"text number {i} " * (1 + i % 5) for i in range(3 * BATCH_TOKENS // 40)]
    out = llm.embed(texts)
    assert len(out) == len(texts) and all(e.vector is not None for e in out)
