"""Per-request types of the facade: `SamplingParams` in, `Completion` out."""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "error"]
_INTEGERS = ("max_new_tokens", "top_k", "seed")


def check_choices(choices: Any) -> tuple[str, ...]:
    """`choices` as a tuple when it is a non-empty sequence of distinct non-empty strings; else a ValueError
    naming the offending item (a bare string is not a list of choices: "yes" is not y, e, s)."""
    if isinstance(choices, (str, bytes, dict)) or not isinstance(choices, Iterable):
        raise ValueError(f"choices must be a list of strings, got {type(choices).__name__} {choices!r}")
    choices = tuple(choices)
    if not choices:
        raise ValueError("choices must not be empty")
    seen: set[str] = set()
    for i, c in enumerate(choices):
        if not isinstance(c, str):
            raise ValueError(f"choices[{i}] must be a string, got {type(c).__name__} {c!r}")
        if not c:
            raise ValueError(f"choices[{i}] must not be empty")
        if c in seen:
            raise ValueError(f"choices[{i}] {c!r} is given twice")
        seen.add(c)
    return choices


@dataclass(frozen=True)
class SamplingParams:
    """How to decode. temperature 0 is greedy. `seed` makes sampling reproducible across runs and batch
    sizes. Exactly one of json_schema / choices / regex may be set (constrained decoding); `chat` applies
    the model's chat template (None: on when the model has one and the prompt is a string)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    json_schema: dict[str, Any] | None = None
    choices: tuple[str, ...] | None = None
    regex: str | None = None
    chat: bool | None = None
    system: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "top_k", "seed", "temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"SamplingParams.{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"SamplingParams.{name} must be a finite number, got {value!r}")
            if name in _INTEGERS and value != int(value):
                raise ValueError(f"SamplingParams.{name} must be an integer, got {value!r}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.choices is not None:
            check_choices(self.choices)
        constraints = [n for n in ("json_schema", "choices", "regex") if getattr(self, n) is not None]
        if len(constraints) > 1:
            raise ValueError(f"SamplingParams: set at most one of json_schema/choices/regex, got {constraints}")


@dataclass
class Completion:
    """One prompt's result. On a per-prompt error, `finish_reason` is "error", `error` says why and
    text is empty. `confidence`: for a constrained output (choices / json_schema / regex) that finished
    ("stop"), how sure the model was of it, in [0, 1] (defined in `engine.decoding.confidence`); else None."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    prompt_tokens: int = 0
    logprobs: list[float] | None = None
    error: str | None = None
    confidence: float | None = None
