"""Strict templates: placeholders, escapes, errors naming the column, few-shot messages, row rendering."""
from __future__ import annotations

import pytest

from llmops.templates import (RowRenderError, TemplateError, build_prompt, check_columns, check_examples,
                              render, render_rows, template_fields)


@pytest.mark.parametrize("template, fields", [
    ("Classify: {body}", ("body",)),
    ("{a} and {b} and {a}", ("a", "b")),
    ("JSON like {{\"x\": 1}} for {row}", ("row",)),
    ("no placeholders", ()),
    ("{first name}", ("first name",)),
])
def test_template_fields(template, fields):
    assert template_fields(template) == fields


@pytest.mark.parametrize("template, fragment", [
    ("{}", "positional"),
    ("{0}", "positional"),
    ("{a.b}", "bare column name"),
    ("{a[0]}", "bare column name"),
    ("{a!r}", "format spec or conversion"),
    ("{a:>5}", "format spec or conversion"),
    ("{a", "malformed"),
    ("a}", "malformed"),
])
def test_bad_templates(template, fragment):
    with pytest.raises(TemplateError, match=fragment):
        template_fields(template)


def test_missing_column_names_it_and_lists_available():
    with pytest.raises(TemplateError) as info:
        check_columns("Hi {name} from {city}", ["name", "country", "zip"])
    msg = str(info.value)
    assert "'city'" in msg and "available columns: name, country, zip" in msg
    assert "'name'" not in msg.split("available")[0]


def test_render_escapes_and_values():
    assert render("{{literal}} {a} {b} {c}", {"a": 1.5, "b": {"k": "v"}, "c": "x"}) == '{literal} 1.5 {"k": "v"} x'
    assert render("{a}", {"a": b"caf\xc3\xa9"}) == "café"
    with pytest.raises(RowRenderError, match="column 'a' holds invalid UTF-8"):
        render("{a}", {"a": b"\xff\xfe"})


def test_build_prompt_plain_and_messages():
    assert build_prompt("Q: {q}", {"q": "hi"}) == "Q: hi"
    msgs = build_prompt("Q: {q}", {"q": "hi"}, system="Be brief.",
                        examples=[{"input": {"q": "1+1"}, "output": "2"},
                                  {"input": {"q": "json"}, "output": {"a": 1}}])
    assert msgs == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: 1+1"}, {"role": "assistant", "content": "2"},
        {"role": "user", "content": "Q: json"}, {"role": "assistant", "content": '{"a": 1}'},
        {"role": "user", "content": "Q: hi"},
    ]


@pytest.mark.parametrize("examples, fragment", [
    ([{"input": {"q": "x"}}], "expected keys 'input' and 'output'"),
    ([{"input": "x", "output": "y"}], "'input' must map column"),
    ([{"input": {"z": "x"}, "output": "y"}], "example 0: .*'q'.*available columns: z"),
])
def test_bad_examples(examples, fragment):
    with pytest.raises(TemplateError, match=fragment):
        check_examples("Q: {q}", examples)


def test_render_rows_nulls_and_errors():
    out = render_rows("{a}-{b}", {"a": ["x", None, b"\xff", "y"], "b": [1, 2, 3, None]}, 4)
    assert out[0].prompt == [{"data": "x"}, "-", {"data": "1"}] and out[0].error is None
    assert out[1].prompt is None and out[1].error is None
    assert out[2].prompt is None and "row 2" in out[2].error and "column 'a'" in out[2].error
    assert out[3].prompt is None and out[3].error is None
