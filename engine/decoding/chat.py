"""Chat templates: render a model's Jinja chat template over a list of messages, in a sandbox.

The environment matches transformers' (`ImmutableSandboxedEnvironment`, trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `tojson`, `strftime_now`), so a template renders the same text here as
there. A template can neither touch the file system nor mutate its arguments.

Data spans (`render_chat_marked`): a message's content may be a list of parts, each a string (template
text) or `{"data": text}` (data). The template is rendered once with each data part replaced by an
unguessable placeholder (a per-call random nonce between private-use characters), and the data is put back
where the placeholders landed, so the result says which characters of the prompt are data. The template is
also rendered with the real contents; when the two texts differ (a template that transforms content, e.g.
`| trim` or `| tojson`), `MarkedText`'s caller chooses (engine.decoding.prompts): the template's own text when the
data added no special-token string, else the verbatim-data text.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = dict[str, Any]
_MARKER = re.compile("\ue000([0-9a-f]{16}):(\\d+)\ue001")  # a data placeholder: nonce, index
Part = str | dict[str, str]   # template text, or {"data": text}


@dataclass(frozen=True)
class RenderedChat:
    """A rendered chat prompt: `text` with its data `spans` ([start, end) characters), the template
    pieces around the data (`text` outside the spans) and, when the template transformed content so
    that rendering the real contents gave other text, that text (`transformed`), else None."""

    text: str
    spans: tuple[tuple[int, int], ...]
    template_pieces: tuple[str, ...]
    transformed: str | None = None


def is_part(value: Any) -> bool:
    """A string (template text) or a `{"data": str}` dict (data)."""
    return isinstance(value, str) or (isinstance(value, dict) and set(value) == {"data"}
                                      and isinstance(value["data"], str))


def check_parts(parts: Any, where: str) -> list[Part]:
    """Validate a list of parts (see `is_part`); errors name the index."""
    if not isinstance(parts, (list, tuple)):
        raise ValueError(f"{where}: expected a list of parts (str or {{'data': str}}), got {type(parts).__name__}")
    for i, part in enumerate(parts):
        if not is_part(part):
            raise ValueError(f"{where}[{i}]: a part is a string (template text) or {{'data': str}}, got {part!r}")
    return list(parts)


def parts_text(parts: Sequence[Part]) -> str:
    """The text of a list of parts (data and template text joined)."""
    return "".join(p if isinstance(p, str) else p["data"] for p in parts)


class ChatTemplateError(ValueError):
    """The template raised (its own `raise_exception`) or is not valid Jinja."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template is not valid Jinja (line {exc.lineno}): {exc.message}") from exc


def check_messages(messages: Sequence[Any], where: str = "messages") -> list[Message]:
    """Validate chat messages: each a dict with string `role` and string `content`. Errors name the index."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: expected a non-empty list of {{role, content}} dicts")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}[{i}]: expected a dict with 'role' and 'content', got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if isinstance(content, (list, tuple)):
            content = check_parts(content, f"{where}[{i}].content")
        elif not isinstance(content, str):
            content = None
        if not isinstance(role, str) or content is None:
            raise ValueError(f"{where}[{i}]: 'role' must be a string and 'content' a string or a list of parts, "
                             f"got {message!r}")
        out.append({**message, "content": content})
    return out


def messages_for(prompt: str | list[Part], system: str | list[Part] | None = None) -> list[Message]:
    """A single-turn conversation: optional system message, then the user's prompt."""
    messages: list[Message] = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": prompt})
    return messages


def render_chat(template: str, messages: Sequence[Message], *, bos_token: str | None = None,
                eos_token: str | None = None, add_generation_prompt: bool = True) -> str:
    """Render `messages` with the chat `template` (Jinja source) and return the prompt text.

    The text already holds the template's special tokens (BOS included when the template writes it):
    encode it with add_special_tokens=False.
    """
    try:
        return _compile(template).render(
            messages=list(messages), bos_token=bos_token or "", eos_token=eos_token or "",
            add_generation_prompt=add_generation_prompt,
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc


def render_chat_marked(template: str, messages: Sequence[Message], *, bos_token: str | None = None,
                       eos_token: str | None = None, add_generation_prompt: bool = True) -> RenderedChat:
    """Render `messages` whose contents are lists of parts (see module docstring) and say where the data
    landed. Contents that are plain strings are rendered as template text."""
    nonce = secrets.token_hex(8)
    data: list[str] = []

    def content(value: str | Sequence[Part], placeholders: bool) -> str:
        if isinstance(value, str):
            return value
        out = []
        for part in value:
            if isinstance(part, str):
                out.append(part)
            elif placeholders:
                out.append(f"\ue000{nonce}:{len(data)}\ue001")
                data.append(part["data"])
            else:
                out.append(part["data"])
        return "".join(out)

    kw = {"bos_token": bos_token, "eos_token": eos_token, "add_generation_prompt": add_generation_prompt}
    shaped = render_chat(template, [{**m, "content": content(m["content"], True)} for m in messages], **kw)
    pieces, spans, out, pos, at = [], [], [], 0, 0
    for m in _MARKER.finditer(shaped):
        if m.group(1) != nonce:  # text that merely looks like a placeholder
            continue
        pieces.append(shaped[pos:m.start()])
        out.append(pieces[-1])
        at += len(pieces[-1])
        value = data[int(m.group(2))]
        out.append(value)
        spans.append((at, at + len(value)))
        at += len(value)
        pos = m.end()
    pieces.append(shaped[pos:])
    out.append(pieces[-1])
    text = "".join(out)
    if len(spans) != len(data):     # the template rewrote a placeholder (`| upper`, `tojson`...): no safe spans
        raise ChatTemplateError(f"the chat template changed {len(data) - len(spans)} of {len(data)} data "
                                "placeholders (it transforms message content), so table values cannot be kept "
                                "apart from its markup")
    if not data:
        return RenderedChat(text, (), tuple(pieces))
    real = render_chat(template, [{**m, "content": content(m["content"], False)} for m in messages], **kw)
    return RenderedChat(text, tuple(spans), tuple(pieces), None if real == text else real)
