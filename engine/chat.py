"""Chat templates: render a model's Jinja chat template over a list of messages, in a sandbox.

The environment matches transformers' (`ImmutableSandboxedEnvironment`, trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `tojson`, `strftime_now`), so a template renders the same text here as
there. A template can neither touch the file system nor mutate its arguments.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = dict[str, Any]


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
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"{where}[{i}]: 'role' and 'content' must be strings, got {message!r}")
        out.append(dict(message))
    return out


def messages_for(prompt: str, system: str | None = None) -> list[Message]:
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
