"""Prompts to token ids: the facade's input forms, chat templating and per-prompt validation.

Prompt forms (`prompt_kind`):
- "text": a string. With the chat template (SamplingParams.chat, or None and the model has one) it is the
  user's message and it is data; without, it is the whole prompt, special-token strings included.
- "parts": a list of parts, each a string (template text) or `{"data": str}` (data): a text prompt that
  says which spans are data. Templated like a string (the parts become the user message's content); raw,
  the parts are joined.
- "messages": chat messages `[{"role", "content"}]`, always templated (system prompt, few-shot turns).
  `content` is a string (data) or a list of parts.
- "ids": a list of token ids, used as is.
A prompt of another type is a TypeError naming its index (a caller's bug); a prompt that cannot run (too long
for the context, empty, template failure) becomes a per-prompt error message, and the others go on.

Data is data: special tokens come only from the chat template and from template-text parts (and from a
raw string prompt, which is all template text). Every string the engine puts into a chat message on its
own (a string prompt, a string message content, SamplingParams.system) and every `{"data"}` part is data:
a special-token string in it (`<|im_end|>`, `<|endoftext|>`) is encoded as ordinary text
(engine.decoding.tokenizer.Tokenizer.encode_marked_batch; engine.decoding.chat.render_chat_marked says where data landed).
A prompt whose data holds no special-token string encodes to the same ids as the unmarked text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from engine.decoding.chat import (ChatTemplateError, Part, RenderedChat, check_messages, is_part, messages_for, parts_text,
                         render_chat_marked)
from engine.decoding.params import SamplingParams
from engine.decoding.tokenizer import MarkedText, Tokenizer


@dataclass
class Encoded:
    """One prompt after encoding: token ids, or an error saying why it cannot run."""

    ids: list[int]
    error: str | None = None


def data(text: str) -> dict[str, str]:
    """A data part: `text` is never read as control tokens."""
    return {"data": text}


def prompt_kind(prompt: Any, index: int) -> str:
    """"text", "parts", "messages" or "ids"; TypeError naming `index` for anything else."""
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, (list, tuple)):
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return "ids"
        if all(is_part(p) for p in prompt):
            return "parts"
        if all(isinstance(m, dict) for m in prompt):
            return "messages"
        raise TypeError(f"prompts[{index}]: a list prompt must hold only token ids (int), only chat messages "
                        f"(dict with 'role'), or only parts (str or {{'data': str}}), "
                        f"got {[type(x).__name__ for x in prompt][:5]}")
    raise TypeError(f"prompts[{index}]: expected str, list of token ids, list of parts or list of chat messages, "
                    f"got {type(prompt).__name__}")


def use_chat(params: SamplingParams, tokenizer: Tokenizer | None) -> bool:
    """Whether string prompts get the chat template: params.chat, or (None) when the model has one."""
    has_template = tokenizer is not None and bool(tokenizer.chat_template)
    if params.chat and not has_template:
        raise ValueError("SamplingParams.chat is True but the model has no chat template")
    if params.system is not None and not (params.chat is not False and has_template):
        raise ValueError("SamplingParams.system needs the chat template (chat=False or the model has none)")
    return has_template if params.chat is None else bool(params.chat)


def as_parts(content: str | Sequence[Part]) -> list[Part]:
    """A message content as parts: a plain string is one data part."""
    return [data(content)] if isinstance(content, str) else list(content)


def marked_raw(prompt: str | Sequence[Part]) -> MarkedText:
    """A raw (untemplated) prompt as text plus data spans: a string is all template text."""
    if isinstance(prompt, str):
        return MarkedText(prompt)
    spans, at = [], 0
    for part in prompt:
        text = part if isinstance(part, str) else part["data"]
        if not isinstance(part, str):
            spans.append((at, at + len(text)))
        at += len(text)
    return MarkedText(parts_text(prompt), tuple(spans))


def choose_text(rendered: RenderedChat, tokenizer: Tokenizer) -> MarkedText:
    """The text to encode for a rendered chat. A template that transforms content (trim, tojson) gave
    other text than the verbatim data: that text is used when it holds no more special-token strings than
    the template's own pieces (the data added none), else the verbatim-data text with its spans."""
    if rendered.transformed is not None:
        own = sum(tokenizer.count_special(p) for p in rendered.template_pieces)
        if tokenizer.count_special(rendered.transformed) == own:
            return MarkedText(rendered.transformed)
    return MarkedText(rendered.text, rendered.spans)


def chat_messages(prompt: Any, kind: str, params: SamplingParams, index: int) -> list[dict[str, Any]]:
    """The conversation of a templated prompt, every content as parts (strings as data)."""
    system = None if params.system is None else as_parts(params.system)
    if kind == "messages":
        messages = check_messages(prompt, f"prompts[{index}]")
        if system is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
    else:
        messages = messages_for(prompt, system)
    return [{**m, "content": as_parts(m["content"])} for m in messages]


def encode_prompts(prompts: Sequence[Any], params: SamplingParams, tokenizer: Tokenizer | None,
                   vocab_size: int, max_context: int) -> list[Encoded]:
    """Encode every prompt (TypeError naming the first prompt of a wrong type, before any work).

    A prompt is an error when it has no tokens, holds an id outside [0, vocab_size), or when
    prompt tokens + params.max_new_tokens exceed `max_context`.
    """
    kinds = [prompt_kind(p, i) for i, p in enumerate(prompts)]
    chat = use_chat(params, tokenizer) if any(k in ("text", "parts") for k in kinds) else False
    out: list[Encoded | None] = [None] * len(prompts)
    templated: list[tuple[int, MarkedText]] = []
    raw: list[tuple[int, MarkedText]] = []
    for i, (prompt, kind) in enumerate(zip(prompts, kinds)):
        if kind == "ids":
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            out[i] = Encoded(list(prompt), f"token id {bad[0]} outside the vocabulary [0, {vocab_size})" if bad else None)
            continue
        if tokenizer is None:
            out[i] = Encoded([], "this model has no tokenizer: pass token-id prompts")
            continue
        if kind in ("text", "parts") and not chat:
            raw.append((i, marked_raw(prompt)))
            continue
        try:
            messages = chat_messages(prompt, kind, params, i)
            if tokenizer.chat_template is None:
                raise ValueError("chat messages need a chat template and the model has none")
            rendered = render_chat_marked(tokenizer.chat_template, messages, bos_token=tokenizer.bos_token,
                                          eos_token=tokenizer.eos_token)
            templated.append((i, choose_text(rendered, tokenizer)))
        except (ChatTemplateError, ValueError) as exc:
            out[i] = Encoded([], str(exc))
    for group, special in ((templated, False), (raw, True)):
        if group:
            ids = tokenizer.encode_marked_batch([text for _, text in group], add_special_tokens=special)
            for (i, _), token_ids in zip(group, ids):
                out[i] = Encoded(token_ids)
    for i, enc in enumerate(out):
        if enc.error is None:
            enc.error = length_error(len(enc.ids), params.max_new_tokens, max_context)
    return out  # type: ignore[return-value]


def length_error(prompt_tokens: int, max_new_tokens: int, max_context: int) -> str | None:
    """Why a prompt of this length cannot run, or None."""
    if prompt_tokens == 0:
        return "prompt is empty (0 tokens)"
    if prompt_tokens + max_new_tokens > max_context:
        return (f"prompt has {prompt_tokens} tokens; with max_new_tokens={max_new_tokens} that is "
                f"{prompt_tokens + max_new_tokens} > the model's context of {max_context} tokens")
    return None
