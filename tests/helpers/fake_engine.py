"""A fake `engine.LLM` for operator-layer tests: same API, deterministic outputs, call accounting.

Text output for a prompt is "echo: <the row's text>" cut to `max_new_tokens` words (finish_reason "length"
when cut, else "stop"). With `json_schema` it returns a valid JSON object whose values derive from the
prompt's hash (unless the prompt contains "CUT": then a cut JSON prefix with finish_reason "length"); with
`choices` it returns the first choice named in the row's text, else one chosen by hash. A prompt longer
than `max_context` characters gives an error Completion. Prompts come in the engine's forms (a string,
parts `["Q: ", {"data": "..."}]`, messages whose content is a string or parts); the row's text is the
parts joined. `prompt_tokens` counts characters plus `prompt_overhead` (a stand-in for a chat template's
built-in system prompt). `fail_at_block=N` raises RuntimeError when block
N (0-based) is about to be yielded by `stream`, simulating a crash after N finished blocks.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from typing import Any

from engine.decoding.params import Completion, SamplingParams


class CharTokenizer:
    """One token per character (what `truncate_prompt` needs: encode/decode)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, str) or (isinstance(p, dict) and set(p) == {"data"})
                                         for p in content):
        return "".join(p if isinstance(p, str) else p["data"] for p in content)
    raise TypeError(f"fake engine: unsupported prompt {content!r}")


def _row_text(prompt: Any) -> str:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) and "role" in prompt[0]:
        return _text(prompt[-1]["content"])
    return _text(prompt)


def _h(prompt: Any) -> int:
    return int(hashlib.sha1(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:8], 16)


def fake_value(schema: dict[str, Any], h: int, name: str = "v", root: dict | None = None) -> Any:
    """A value valid for JSON schema `schema`, derived from the integer `h`."""
    root = root or schema
    while "$ref" in schema:
        target: Any = root
        for part in schema["$ref"][2:].split("/"):
            target = target[part]
        schema = target
    for key in ("anyOf", "oneOf"):
        if key in schema:
            schema = next(s for s in schema[key] if s.get("type") != "null")
    if "enum" in schema:
        return schema["enum"][h % len(schema["enum"])]
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next(k for k in kind if k != "null")
    if kind == "object" or "properties" in schema:
        return {k: fake_value(v, h + i, k, root) for i, (k, v) in enumerate(schema.get("properties", {}).items())}
    if kind == "array":
        return [fake_value(schema.get("items", {}), h, name, root)]
    if kind == "integer":
        return h % 1000
    if kind == "number":
        return (h % 10000) / 100
    if kind == "boolean":
        return h % 2 == 0
    return f"{name}-{h % 997}"


class FakeLLM:
    """Deterministic stand-in for `engine.LLM` (see module docstring). Counts every prompt it sees."""

    def __init__(self, *, fingerprint: str = "fake-model-v1", block_size: int = 4, max_context: int = 10_000,
                 fail_at_block: int | None = None, prompt_overhead: int = 0) -> None:
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.max_context = max_context
        self.fail_at_block = fail_at_block
        self.prompt_overhead = prompt_overhead
        self.tokenizer = CharTokenizer()
        self.seen: Counter[str] = Counter()
        self.calls = 0
        self.last_params: SamplingParams | None = None
        self._lock = threading.Lock()

    @property
    def prompts_seen(self) -> int:
        """Total prompts generated (duplicates across calls included)."""
        return sum(self.seen.values())

    def prompt_tokens(self, prompts: list[Any], params: SamplingParams | None = None) -> list[int]:
        """Characters of each prompt's row text plus `prompt_overhead` (what `truncate_prompts` counts)."""
        return [self.prompt_overhead + len(_row_text(p)) for p in prompts]

    def complete(self, prompt: Any, params: SamplingParams) -> Completion:
        """The deterministic completion of one prompt."""
        text = _row_text(prompt)
        n_prompt = len(json.dumps(prompt)) if not isinstance(prompt, str) else len(prompt)
        if self.prompt_overhead + len(text) > self.max_context:
            return Completion("", [], "error", n_prompt, error=f"prompt of {self.prompt_overhead + len(text)} "
                                                              f"tokens exceeds the context of {self.max_context}")
        h = _h(prompt)
        if params.json_schema is not None:
            full = json.dumps(fake_value(params.json_schema, h))
            if "CUT" in text:
                return Completion(full[: len(full) // 2], [1] * params.max_new_tokens, "length", n_prompt)
            return Completion(full, [1] * len(full.split()), "stop", n_prompt)
        if params.choices is not None:
            named = [c for c in params.choices if c in text]
            choice = named[0] if named else params.choices[h % len(params.choices)]
            return Completion(choice, [1], "stop", n_prompt)
        words = ("echo: " + text).split(" ")
        cut = len(words) > params.max_new_tokens
        words = words[: params.max_new_tokens]
        return Completion(" ".join(words), [1] * len(words), "length" if cut else "stop", n_prompt)

    def generate(self, prompts: list[Any], params: SamplingParams | None = None) -> list[Completion]:
        return [c for group in self.stream(prompts, params) for _, c in sorted(group, key=lambda x: x[0])]

    def stream(self, prompts: list[Any], params: SamplingParams | None = None):
        params = params or SamplingParams()
        with self._lock:
            self.calls += 1
            self.last_params = params
        for b, start in enumerate(range(0, len(prompts), self.block_size)):
            if self.fail_at_block is not None and b == self.fail_at_block:
                raise RuntimeError(f"fake engine crashed at block {b}")
            group = []
            for i in range(start, min(start + self.block_size, len(prompts))):
                with self._lock:
                    self.seen[json.dumps(prompts[i], sort_keys=True)] += 1
                group.append((i, self.complete(prompts[i], params)))
            yield group[::-1]
