"""`on_long_prompt: truncate`: over-long prompts cut in their row data until they fit the engine's context.
Talks to the engine only through the object it is given (`tokenizer`, `max_context`, `prompt_tokens`)."""
from __future__ import annotations

from typing import Any

from llmops.templates import Prompt, cut_data, parts_text


def truncate_prompts(prompts: list[Prompt], eng: Any, max_new_tokens: int,
                     params: Any = None) -> list[Prompt]:
    """Cut each over-long prompt's row data (`llmops.templates.cut_data`) so that the prompt plus
    `max_new_tokens` fits `eng.max_context`. Lengths are the engine's own count (`eng.prompt_tokens`: the
    chat template, the model's built-in system prompt, the system prompt and examples included), checked
    again after each cut (a cut can merge or split a token at its edge). Without `eng.prompt_tokens` the
    length is estimated (row text plus a margin per message). Needs `eng.tokenizer` (encode/decode) and
    `eng.max_context`; prompts are returned unchanged without them. A prompt whose template text alone
    is too long stays as it is (the engine then reports it)."""
    tok, limit = getattr(eng, "tokenizer", None), getattr(eng, "max_context", None)
    if tok is None or not limit:
        return list(prompts)
    budget = int(limit) - max_new_tokens
    count = getattr(eng, "prompt_tokens", None)
    if count is None:
        def count(ps: list[Prompt], _: Any) -> list[int]:
            return [_estimate_tokens(p, tok) for p in ps]
    out = list(prompts)
    lengths = count(out, params)
    for i, n in enumerate(lengths):
        for _ in range(8):
            if n <= budget:
                break
            cut = cut_data(out[i], n - budget, lambda t: tok.encode(t, add_special_tokens=False),
                           lambda ids: tok.decode(ids, skip_special_tokens=False))
            if cut is None:
                break
            out[i] = cut
            n = count([cut], params)[0]
    return out


def truncate_prompt(prompt: Prompt, eng: Any, max_new_tokens: int, params: Any = None) -> Prompt:
    """`truncate_prompts` for one prompt."""
    return truncate_prompts([prompt], eng, max_new_tokens, params)[0]


def _estimate_tokens(prompt: Prompt, tok: Any) -> int:
    """A prompt's length for an engine that cannot count it: its text plus 8 tokens of markup per message
    and 16 for the template's frame."""
    messages = prompt if prompt and isinstance(prompt[0], dict) and "role" in prompt[0] else [{"content": prompt}]
    return 16 + sum(8 + len(tok.encode(parts_text(m["content"]), add_special_tokens=False)) for m in messages)
