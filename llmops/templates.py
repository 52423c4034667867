"""Prompt templates: strict `{column}` placeholders, system prompt, few-shot examples -> engine prompts.

A template is `str.format` syntax restricted to bare names: `{body}` is the value of column `body`;
`{{` and `}}` are literal braces. Positional (`{}`, `{0}`), attribute (`{a.b}`), index (`{a[0]}`),
conversion (`{a!r}`) and format-spec (`{a:>5}`) fields are rejected when the template is parsed, so
every error surfaces before any generation. Rendering never touches the engine: it turns one row
(a mapping of column -> Python value) into either a plain string (no system prompt, no examples) or a
list of chat messages `[{"role", "content"}]` (system, then user/assistant turns per example, then the
row's user turn); the engine applies the model's chat template to both (SamplingParams.chat).
"""
from __future__ import annotations

import json
import string
from dataclasses import dataclass
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Prompt = str | list[dict[str, str]]


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


def build_prompt(template: str, row: Mapping[str, Any], *, system: str | None = None,
                 examples: Sequence[Mapping[str, Any]] = ()) -> Prompt:
    """The engine prompt for one row: the rendered string when there is no system prompt and no
    example, else chat messages: system, (user, assistant) per example, then the row's user turn."""
    user = render(template, row)
    if system is None and not examples:
        return user
    messages: list[dict[str, str]] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    for ex in examples:
        messages.append({"role": "user", "content": render(template, ex["input"])})
        messages.append({"role": "assistant", "content": _example_output(ex["output"])})
    messages.append({"role": "user", "content": user})
    return messages


@dataclass(frozen=True)
class RowOutcome:
    """One row's rendering: a prompt, or (prompt None) a null row (error None) or a failed row."""

    prompt: Prompt | None
    error: str | None = None


def render_rows(template: str, columns: Mapping[str, Sequence[Any]], num_rows: int, *,
                system: str | None = None, examples: Sequence[Mapping[str, Any]] = ()) -> list[RowOutcome]:
    """Render every row of a column-major table (`columns[name][i]`, holding each placeholder).

    A None in any placeholder column makes a null row; a row that cannot be rendered becomes a failed
    row whose error names the row and column. A template without placeholders gives one prompt per row."""
    fields = template_fields(template)
    check_columns(template, columns.keys())
    out: list[RowOutcome] = []
    for i in range(num_rows):
        row = {f: columns[f][i] for f in fields}
        if any(v is None for v in row.values()):
            out.append(RowOutcome(None))
            continue
        try:
            out.append(RowOutcome(build_prompt(template, row, system=system, examples=examples)))
        except RowRenderError as exc:
            out.append(RowOutcome(None, f"row {i}: {exc}"))
    return out
