"""Polars spellings of the semantic operators (re-exported as `llmops.llm_filter`, `llmops.llm_join`,
`llmops.resolve`, `llmops.llm_reduce`).

`llm_filter(template, ...)` is a boolean `pl.Expr` (`df.filter(llmops.llm_filter("Is this a bug report?
{body}"))`), an `llm_map` constrained to Yes/No, so it is one job per expression like `llm_map`.
`filter_frame` adds a reason column. The others take frames (eager; a LazyFrame is collected) and return a
DataFrame: `llm_join(left, right, on=...)` the matched pairs with `similarity` and `confidence`,
`resolve(df, on=...)` the frame with an entity id column, `llm_reduce(df, by, template)` one row per group.
`with_report=True` returns `(frame, report)`. Keyword arguments are those of `llmops.semantic.options.Llm.of`
(model, validate, max_attempts, cache_dir, progress, engine and MapSpec's generation settings);
`blocking` is a `Blocking` or a dict of its fields.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl

from llmops.polars import llm_map
from llmops.semantic import filter as semantic_filter
from llmops.semantic.blocking import Blocking
from llmops.semantic.join import llm_join_table
from llmops.semantic.options import Llm
from llmops.semantic.reduce import llm_reduce_table
from llmops.semantic.resolve import resolve_table

Frame = pl.DataFrame | pl.LazyFrame


def _eager(df: Frame) -> pl.DataFrame:
    return df.collect() if isinstance(df, pl.LazyFrame) else df


def _blocking(blocking: Blocking | Mapping[str, Any] | None) -> Blocking:
    if blocking is None:
        return Blocking()
    return blocking if isinstance(blocking, Blocking) else Blocking(**dict(blocking))


def _out(frame: pl.DataFrame, report: Any, with_report: bool) -> Any:
    return (frame, report) if with_report else frame


def llm_filter(template: str, **kwargs: Any) -> pl.Expr:
    """True where the model answers Yes to `template` (null where it gave no answer). kwargs: `llm_map`'s."""
    kwargs.setdefault("system", semantic_filter.SYSTEM)
    kwargs.setdefault("max_new_tokens", 4)
    return (llm_map(template, choices=[semantic_filter.YES, semantic_filter.NO], **kwargs)
            == semantic_filter.YES).alias("llm_filter")


def filter_frame(df: Frame, template: str, *, reason: str | None = None, **kwargs: Any) -> pl.DataFrame:
    """The rows the model keeps, with its reason in column `reason` when named (validated and retried
    when `validate` is given)."""
    table = semantic_filter.llm_filter_table(_eager(df).to_arrow(), template, Llm.of(**kwargs), reason_column=reason)
    return pl.from_arrow(table)


def llm_join(left: Frame, right: Frame, *, on: Sequence[str] | str | None = None,
             left_on: Sequence[str] | str | None = None, right_on: Sequence[str] | str | None = None,
             blocking: Blocking | Mapping[str, Any] | None = None, template: str | None = None,
             min_confidence: float = 0.5, suffix: str = "_right", with_report: bool = False, **kwargs: Any) -> Any:
    """Matched pairs of `left` and `right` compared on `on` (or `left_on`/`right_on`), see
    `llmops.semantic.join`."""
    lo = left_on if left_on is not None else on
    ro = right_on if right_on is not None else lo
    if lo is None:
        raise ValueError("llm_join: give `on` or `left_on`/`right_on` (the columns to compare)")
    as_list = (lambda v: [v] if isinstance(v, str) else list(v))  # noqa: E731
    table, report = llm_join_table(_eager(left).to_arrow(), _eager(right).to_arrow(), Llm.of(**kwargs),
                                   left_on=as_list(lo), right_on=as_list(ro), blocking=_blocking(blocking),
                                   template=template, min_confidence=min_confidence, suffix=suffix)
    return _out(pl.from_arrow(table), report, with_report)


def resolve(df: Frame, *, on: Sequence[str] | str, blocking: Blocking | Mapping[str, Any] | None = None,
            template: str | None = None, output: str = "entity_id", id_column: str | None = None,
            with_report: bool = False, **kwargs: Any) -> Any:
    """`df` with an entity id column (see `llmops.semantic.resolve`)."""
    table, report = resolve_table(_eager(df).to_arrow(), [on] if isinstance(on, str) else list(on), Llm.of(**kwargs),
                                  blocking=_blocking(blocking), template=template, output=output, id_column=id_column)
    return _out(pl.from_arrow(table), report, with_report)


def llm_reduce(df: Frame, by: Sequence[str] | str, template: str, *, item: str | None = None, output: str = "output",
               fold_template: str | None = None, max_prompt_tokens: int | None = None, schema: Any = None,
               choices: Sequence[str] | None = None, regex: str | None = None, with_report: bool = False,
               **kwargs: Any) -> Any:
    """One row per group of `by` with the reduced `output` (see `llmops.semantic.reduce`)."""
    constraint = {"schema": schema, "choices": choices, "regex": regex,
                  "max_new_tokens": kwargs.pop("max_new_tokens", None)}
    table, report = llm_reduce_table(_eager(df).to_arrow(), [by] if isinstance(by, str) else list(by), template,
                                     Llm.of(**kwargs), item=item, output=output, fold_template=fold_template,
                                     max_prompt_tokens=max_prompt_tokens, **constraint)
    return _out(pl.from_arrow(table), report, with_report)
