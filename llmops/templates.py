"""Prompt templates: strict `{column}` placeholders, system prompt, few-shot examples -> engine prompts.

A template is `str.format` syntax restricted to bare names: `{body}` is the value of column `body`;
`{{` and `}}` are literal braces. Positional (`{}`, `{0}`), attribute (`{a.b}`), index (`{a[0]}`),
conversion (`{a!r}`) and format-spec (`{a:>5}`) fields are rejected when the template is parsed, so
every error surfaces before any generation. Rendering never touches the engine: it turns one row
(a mapping of column -> Python value) into either a list of parts (no system prompt, no examples) or a
list of chat messages `[{"role", "content": parts}]` (system, then user/assistant turns per example, then
the row's user turn); the engine applies the model's chat template to both (SamplingParams.chat).

Data is data. A part is a string (text the user wrote: the template's literal text, the system prompt) or
`{"data": text}` (a value: a cell, an example's input value or output). This is the contract with the
engine (engine/decoding/prompts.py): the engine reads special-token strings (`<|im_end|>`) as control tokens only
in template text and in the chat template, and encodes data as plain text. Plain dicts, so a prompt's JSON
(the result-cache key) tells a value from template text. `build_prompt` / `prompt_text` give the same
prompt unmarked, for people (dry runs).

Empty values: a placeholder value that is empty or whitespace only makes the row `RowOutcome(None,
"row i: column 'c' is empty", finish_reason)` under `on_empty="null"` (finish_reason None, like a null) or
`"error"` (finish_reason "error"); `"run"` sends it to the model.
"""
from __future__ import annotations

import json
import string
from dataclasses import dataclass
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

Part = str | dict[str, str]                 # template text, or {"data": value text}
Prompt = list[Part] | list[dict[str, Any]]  # parts, or chat messages whose content is a list of parts
OnEmpty = Literal["null", "error", "run"]
ON_EMPTY: tuple[str, ...] = ("null", "error", "run")


class TemplateError(ValueError):
    """A template is malformed or names a column the input does not have (a job-level error)."""


class RowRenderError(ValueError):
    """One row could not be rendered (invalid UTF-8 bytes, ...): a per-row error, the job goes on."""


def template_fields(template: str) -> tuple[str, ...]:
    """The distinct placeholder names of `template`, in order of first appearance.

    Raises TemplateError for unbalanced braces or any field that is not a bare name."""
    if not isinstance(template, str):
        raise TemplateError(f"template must be a string, got {type(template).__name__}")
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise TemplateError(f"malformed template {template!r}: {exc} (write '{{{{' / '}}}}' for literal braces)")
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name == "" or name.isdigit():
            raise TemplateError(f"template {template!r}: positional placeholder '{{{name}}}' is not allowed; "
                                "name a column, e.g. '{body}'")
        if "." in name or "[" in name:
            raise TemplateError(f"template {template!r}: placeholder '{{{name}}}' must be a bare column name "
                                "(no attributes, indexes)")
        if spec or conversion:
            raise TemplateError(f"template {template!r}: placeholder '{{{name}}}' may not carry a format spec "
                                "or conversion")
        if name not in names:
            names.append(name)
    return tuple(names)


def check_columns(template: str, columns: Iterable[str], *, what: str = "input") -> tuple[str, ...]:
    """Validate that every placeholder of `template` is one of `columns`; return the placeholder names.

    The error names each missing placeholder and lists the available columns."""
    fields = template_fields(template)
    available = list(columns)
    missing = [f for f in fields if f not in available]
    if missing:
        raise TemplateError(
            f"template {template!r} uses {', '.join(repr(m) for m in missing)} which "
            f"{'is' if len(missing) == 1 else 'are'} not a column of the {what}; "
            f"available columns: {', '.join(available) if available else '(none)'}"
        )
    return fields


def format_value(value: Any, column: str) -> str:
    """The text a cell contributes to a prompt. Bytes must be valid UTF-8 (else RowRenderError naming
    `column`); dicts/lists render as compact JSON; everything else via str()."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RowRenderError(f"column {column!r} holds invalid UTF-8 bytes ({exc.reason} at byte {exc.start})")
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def render(template: str, row: Mapping[str, Any]) -> str:
    """Fill `template` with `row` (column -> value). Missing names raise TemplateError."""
    fields = check_columns(template, row.keys(), what="row")
    return template.format_map({f: format_value(row[f], f) for f in fields})


def render_parts(template: str, row: Mapping[str, Any]) -> list[Part]:
    """`render`, marked: the template's literal text as strings, each value as `{"data": text}`."""
    check_columns(template, row.keys(), what="row")
    parts: list[Part] = []
    for literal, name, _, _ in string.Formatter().parse(template):
        if literal:
            if parts and isinstance(parts[-1], str):
                parts[-1] += literal
            else:
                parts.append(literal)
        if name is not None:
            parts.append({"data": format_value(row[name], name)})
    return parts


def parts_text(parts: Sequence[Part]) -> str:
    """The text of a list of parts, values and template text joined."""
    return "".join(p if isinstance(p, str) else p["data"] for p in parts)


def prompt_text(prompt: Prompt) -> str | list[dict[str, Any]]:
    """A marked prompt unmarked: a string, or messages with string contents."""
    if prompt and isinstance(prompt[0], dict) and "role" in prompt[0]:
        return [{**m, "content": parts_text(m["content"])} for m in prompt]  # type: ignore[index]
    return parts_text(prompt)  # type: ignore[arg-type]


def empty_columns(row: Mapping[str, Any]) -> list[str]:
    """The columns whose value renders to empty or whitespace-only text (str, bytes)."""
    out = []
    for name, value in row.items():
        if isinstance(value, (bytes, bytearray, memoryview)):
            value = bytes(value).decode("utf-8", "replace")
        if isinstance(value, str) and not value.strip():
            out.append(name)
    return out


def _example_output(output: Any) -> str:
    if isinstance(output, str):
        return output
    return json.dumps(output, ensure_ascii=False)


def check_examples(template: str, examples: Sequence[Mapping[str, Any]]) -> None:
    """Each example is {"input": {column: value}, "output": str | dict}; its input must fill `template`."""
    for i, ex in enumerate(examples):
        if not isinstance(ex, Mapping) or set(ex) != {"input", "output"}:
            keys = sorted(ex) if isinstance(ex, Mapping) else type(ex).__name__
            raise TemplateError(f"example {i}: expected keys 'input' and 'output', got {keys}")
        if not isinstance(ex["input"], Mapping):
            raise TemplateError(f"example {i}: 'input' must map column -> value, got {type(ex['input']).__name__}")
        try:
            check_columns(template, ex["input"].keys(), what=f"example {i} input")
        except TemplateError as exc:
            raise TemplateError(f"example {i}: {exc}") from None


def prefix_messages(template: str, *, system: str | None = None,
                    examples: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """The chat turns every row's prompt starts with: system (template text), then (user, assistant) per
    example (values as data). Rows share these dicts: treat them as read-only."""
    messages: list[dict[str, Any]] = []
    if system is not None:
        messages.append({"role": "system", "content": [system]})
    for ex in examples:
        messages.append({"role": "user", "content": render_parts(template, ex["input"])})
        messages.append({"role": "assistant", "content": [{"data": _example_output(ex["output"])}]})
    return messages


def build_marked_prompt(template: str, row: Mapping[str, Any], *, system: str | None = None,
                        examples: Sequence[Mapping[str, Any]] = (),
                        prefix: list[dict[str, Any]] | None = None) -> Prompt:
    """The engine prompt for one row: the rendered parts when there is no system prompt and no example,
    else chat messages: `prefix_messages` (or `prefix`, computed once for many rows), then the row's user
    turn."""
    user = render_parts(template, row)
    if system is None and not examples:
        return user
    head = prefix if prefix is not None else prefix_messages(template, system=system, examples=examples)
    return [*head, {"role": "user", "content": user}]


def build_prompt(template: str, row: Mapping[str, Any], *, system: str | None = None,
                 examples: Sequence[Mapping[str, Any]] = ()) -> str | list[dict[str, Any]]:
    """`build_marked_prompt` unmarked (`prompt_text`): the text a person reads."""
    return prompt_text(build_marked_prompt(template, row, system=system, examples=examples))


@dataclass(frozen=True)
class RowOutcome:
    """One row's rendering: a prompt, or (prompt None) a row that does not run: a null row (error and
    finish_reason None), an empty row (error says which column; finish_reason per on_empty) or a failed
    row (finish_reason "error")."""

    prompt: Prompt | None
    error: str | None = None
    finish_reason: str | None = None


def render_rows(template: str, columns: Mapping[str, Sequence[Any]], num_rows: int, *,
                system: str | None = None, examples: Sequence[Mapping[str, Any]] = (),
                on_empty: OnEmpty = "null") -> list[RowOutcome]:
    """Render every row of a column-major table (`columns[name][i]`, holding each placeholder).

    A None in any placeholder column makes a null row; an empty or whitespace-only value an empty row
    (see module docstring; `on_empty="run"` renders it); a row that cannot be rendered becomes a failed
    row whose error names the row and column. A template without placeholders gives one prompt per row."""
    if on_empty not in ON_EMPTY:
        raise ValueError(f"on_empty must be one of {', '.join(ON_EMPTY)}, got {on_empty!r}")
    fields = template_fields(template)
    check_columns(template, columns.keys())
    prefix = prefix_messages(template, system=system, examples=examples)
    out: list[RowOutcome] = []
    for i in range(num_rows):
        row = {f: columns[f][i] for f in fields}
        if any(v is None for v in row.values()):
            out.append(RowOutcome(None))
            continue
        empty = empty_columns(row) if on_empty != "run" else []
        if empty:
            names = ", ".join(repr(c) for c in empty)
            what = f"column {names} is" if len(empty) == 1 else f"columns {names} are"
            out.append(RowOutcome(None, f"row {i}: {what} empty", "error" if on_empty == "error" else None))
            continue
        try:
            out.append(RowOutcome(build_marked_prompt(template, row, system=system, examples=examples,
                                                      prefix=prefix)))
        except RowRenderError as exc:
            out.append(RowOutcome(None, f"row {i}: {exc}", "error"))
    return out


def cut_data(prompt: Prompt, tokens: int, encode: Callable[[str], list[int]],
             decode: Callable[[list[int]], str]) -> Prompt | None:
    """`prompt` with its row's data `tokens` tokens shorter (`on_long_prompt: truncate`): the data parts
    of the row's own turn (the last message, or the parts prompt), the longest first, each cut at its
    end; template text, the system prompt and examples are never cut. None when the data is all gone
    before `tokens` were cut. `encode`/`decode`: the model's tokenizer on plain text."""
    is_messages = bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]  # type: ignore[index]
    own = prompt[-1]["content"] if is_messages else prompt  # type: ignore[index]
    parts: list[Part] = [{"data": own}] if isinstance(own, str) else list(own)  # a plain string is all data
    ids = {j: encode(p["data"]) for j, p in enumerate(parts) if isinstance(p, dict)}
    left = tokens
    while left > 0:
        j = max(ids, key=lambda k: len(ids[k]), default=None)
        if j is None or not ids[j]:
            return None
        keep = max(0, len(ids[j]) - left)
        left -= len(ids[j]) - keep
        ids[j] = ids[j][:keep]
        parts[j] = {"data": decode(ids[j]) if keep else ""}
    if is_messages:
        return [*prompt[:-1], {**prompt[-1], "content": parts}]  # type: ignore[list-item, dict-item]
    return parts
