"""A fake engine whose answers a test scripts: `ScriptedLLM(answer)` calls `answer(text, params)` for each prompt
(text: the prompt's user turn, template text and data joined) and returns its string as a finished completion,
with `confidence` when the answer is a (text, confidence) pair. Prompts are counted like `FakeLLM`'s; `embed`
gives unit-length bag-of-words vectors (one dimension per word of `vocabulary`), or without a vocabulary
character trigrams hashed into `DIMS` dimensions, so texts sharing words or spellings are near."""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.decoding.params import Completion, SamplingParams
from helpers.fake_engine import FakeLLM, _row_text

DIMS = 64
Answer = Callable[[str, SamplingParams], "str | tuple[str, float]"]


@dataclass(frozen=True)
class FakeEmbedding:
    vector: list[float] | None
    tokens: int
    error: str | None = None


class ScriptedLLM(FakeLLM):
    """`FakeLLM` with scripted answers (see module docstring); `embedded` counts the texts `embed` was given."""

    def __init__(self, answer: Answer | None = None, *, vocabulary: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.answer = answer
        self.vocabulary = [w.lower() for w in vocabulary]
        self.embedded = 0
        self.embed_calls = 0

    def complete(self, prompt: Any, params: SamplingParams) -> Completion:
        if self.answer is None:
            return super().complete(prompt, params)
        got = self.answer(_row_text(prompt), params)
        text, confidence = got if isinstance(got, tuple) else (got, None)
        return Completion(text, [1] * max(1, len(text.split())), "stop", len(_row_text(prompt)),
                          confidence=confidence)

    def embed(self, texts: list[str]) -> list[FakeEmbedding]:
        self.embed_calls += 1
        self.embedded += len(texts)
        out = []
        for text in texts:
            words = re.findall(r"\w+", text.lower())
            if not words:
                out.append(FakeEmbedding(None, 0, "empty text"))
                continue
            v = [float(words.count(w)) for w in self.vocabulary] if self.vocabulary else _trigrams(text.lower())
            norm = math.sqrt(sum(x * x for x in v)) or 1.0
            out.append(FakeEmbedding([x / norm for x in v], len(words)))
        return out


def _trigrams(text: str) -> list[float]:
    v = [0.0] * DIMS
    padded = f"  {text} "
    for i in range(len(padded) - 2):
        v[sum(map(ord, padded[i:i + 3])) % DIMS] += 1.0
    return v
