"""Prompts to token ids: the facade's input forms, chat templating and per-prompt validation.

A prompt is a string (chat template applied when asked or when the model has one), a list of chat
messages (always templated: system prompt and few-shot turns), or a list of token ids (used as is). A
prompt of another type is a TypeError naming its index (a caller's bug); a prompt that cannot run (too long
for the context, empty, template failure) becomes a per-prompt error message, and the others go on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from engine.chat import ChatTemplateError, check_messages, messages_for, render_chat
from engine.params import SamplingParams
from engine.tokenizer import Tokenizer


@dataclass
class Encoded:
    """One prompt after encoding: token ids, or an error saying why it cannot run."""

    ids: list[int]
    error: str | None = None


def prompt_kind(prompt: Any, index: int) -> str:
    """"text", "messages" or "ids"; TypeError naming `index` for anything else."""
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, (list, tuple)):
        if prompt and all(isinstance(m, dict) for m in prompt):
            return "messages"
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return "ids"
        raise TypeError(f"prompts[{index}]: a list prompt must hold only token ids (int) or only chat "
                        f"messages (dict), got {[type(x).__name__ for x in prompt][:5]}")
    raise TypeError(f"prompts[{index}]: expected str, list of token ids or list of chat messages, "
                    f"got {type(prompt).__name__}")


def use_chat(params: SamplingParams, tokenizer: Tokenizer | None) -> bool:
    """Whether string prompts get the chat template: params.chat, or (None) when the model has one."""
    has_template = tokenizer is not None and bool(tokenizer.chat_template)
    if params.chat and not has_template:
        raise ValueError("SamplingParams.chat is True but the model has no chat template")
    if params.system is not None and not (params.chat is not False and has_template):
        raise ValueError("SamplingParams.system needs the chat template (chat=False or the model has none)")
    return has_template if params.chat is None else bool(params.chat)


def encode_prompts(prompts: Sequence[Any], params: SamplingParams, tokenizer: Tokenizer | None,
                   vocab_size: int, max_context: int) -> list[Encoded]:
    """Encode every prompt (TypeError naming the first prompt of a wrong type, before any work).

    A prompt is an error when it has no tokens, holds an id outside [0, vocab_size), or when
    prompt tokens + params.max_new_tokens exceed `max_context`.
    """
    kinds = [prompt_kind(p, i) for i, p in enumerate(prompts)]
    chat = use_chat(params, tokenizer) if any(k == "text" for k in kinds) else False
    out: list[Encoded | None] = [None] * len(prompts)
    templated: list[tuple[int, str]] = []
    raw: list[tuple[int, str]] = []
    for i, (prompt, kind) in enumerate(zip(prompts, kinds)):
        if kind == "ids":
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            out[i] = Encoded(list(prompt), f"token id {bad[0]} outside the vocabulary [0, {vocab_size})" if bad else None)
            continue
        if tokenizer is None:
            out[i] = Encoded([], "this model has no tokenizer: pass token-id prompts")
            continue
        if kind == "text" and not chat:
            raw.append((i, prompt))
            continue
        try:
            if kind == "messages":
                messages = check_messages(prompt, f"prompts[{i}]")
                if params.system is not None and messages[0]["role"] != "system":
                    messages.insert(0, {"role": "system", "content": params.system})
            else:
                messages = messages_for(prompt, params.system)
            if tokenizer.chat_template is None:
                raise ValueError("chat messages need a chat template and the model has none")
            templated.append((i, render_chat(tokenizer.chat_template, messages, bos_token=tokenizer.bos_token,
                                             eos_token=tokenizer.eos_token)))
        except (ChatTemplateError, ValueError) as exc:
            out[i] = Encoded([], str(exc))
    for group, special in ((templated, False), (raw, True)):
        if group:
            ids = tokenizer.encode_batch([text for _, text in group], add_special_tokens=special)
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
