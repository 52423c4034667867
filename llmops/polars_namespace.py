"""Opt-in `.llm` expression namespace: `import llmops.polars_namespace` then
`pl.col("body").llm.map("Classify: {text}", choices=[...])`.

The template must have exactly one placeholder (any name); it is bound to the expression the namespace
hangs off. All keyword arguments are those of `llmops.polars.llm_map`.
"""
from __future__ import annotations

from typing import Any

import polars as pl

from llmops.polars import llm_map
from llmops.templates import TemplateError, template_fields


@pl.api.register_expr_namespace("llm")
class LlmNamespace:
    """`expr.llm.map(template, **kwargs)`: llm_map with the template's single placeholder bound to expr."""

    def __init__(self, expr: pl.Expr) -> None:
        self._expr = expr

    def map(self, template: str, **kwargs: Any) -> pl.Expr:
        names = template_fields(template)
        if len(names) != 1:
            raise TemplateError(f"expr.llm.map: template {template!r} must have exactly one placeholder "
                                f"(the expression's value), found {list(names)}")
        return llm_map(template, columns={names[0]: self._expr}, **kwargs)
