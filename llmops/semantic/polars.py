"""Polars spellings of the semantic operators (re-exported as `llmops.llm_filter`, `llmops.llm_join`,
`llmops.resolve`, `llmops.llm_reduce`, `llmops.llm_topk`, `llmops.llm_extract`, `llmops.embed`,
`llmops.sim_join`, `llmops.split`, `llmops.gather`).

`llm_filter(template, ...)` is a boolean `pl.Expr` (`df.filter(llmops.llm_filter("Is this a bug report?
{body}"))`), an `llm_map` constrained to Yes/No, so it is one job per expression like `llm_map`.
`filter_frame` adds a reason column. The others take frames (eager; a LazyFrame is collected) and return a
DataFrame: `llm_join(left, right, on=...)` the matched pairs with `similarity` and `confidence`,
`resolve(df, on=...)` the frame with an entity id column, `llm_reduce(df, by, template)` one row per group.
`llm_topk(df, template, k)` the k best rows with a `rank` column, `llm_extract(df, column, fields)` a struct
of verbatim quotes, `embed(df, column)` an embedding column, `sim_join(left, right, on=..., k=...)` pairs by
cosine similarity, `split(df, column, chunk_size=...)` one row per chunk and `gather(df, column)` one row per
document. `with_report=True` returns `(frame, report)`. Keyword arguments are those of
`llmops.semantic.options.Llm.of` (model, validate, max_attempts, cache_dir, progress, engine and MapSpec's
generation settings); `blocking` is a `Blocking`, an `EmbeddingBlocking`, "embedding" or a dict of fields
(`llmops.semantic.embed_blocking.as_blocking`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl

from llmops.polars import llm_map
from llmops.semantic import filter as semantic_filter
from llmops.semantic.embed import embed_table, sim_join_table
from llmops.semantic.embed_blocking import AnyBlocking, as_blocking
from llmops.semantic.extract import llm_extract_table
from llmops.semantic.join import llm_join_table
from llmops.semantic.options import Llm
from llmops.semantic.reduce import llm_reduce_table
from llmops.semantic.resolve import resolve_table
from llmops.semantic.split import CHUNK_INDEX, DOC_ID, Unit, gather_table, model_tokenizer, split_table
from llmops.semantic.topk import llm_topk_table

Frame = pl.DataFrame | pl.LazyFrame


def _eager(df: Frame) -> pl.DataFrame:
    return df.collect() if isinstance(df, pl.LazyFrame) else df


def _blocking(blocking: AnyBlocking | Mapping[str, Any] | str | None) -> AnyBlocking:
    return as_blocking(blocking)


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
             blocking: AnyBlocking | Mapping[str, Any] | str | None = None, template: str | None = None,
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


def resolve(df: Frame, *, on: Sequence[str] | str, blocking: AnyBlocking | Mapping[str, Any] | str | None = None,
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


def llm_topk(df: Frame, template: str, k: int, *, rank: str = "rank", seed: int = 0, with_report: bool = False,
             **kwargs: Any) -> Any:
    """The `k` rows that best answer `template`'s question, best first, with `rank` (see
    `llmops.semantic.topk`)."""
    table, report = llm_topk_table(_eager(df).to_arrow(), template, k, Llm.of(**kwargs), rank=rank, seed=seed)
    return _out(pl.from_arrow(table), report, with_report)


def llm_extract(df: Frame, column: str, fields: Sequence[str] | Mapping[str, str], *, quotes: bool = True,
                output: str = "extracted", gleaning: int = 1, with_report: bool = False, **kwargs: Any) -> Any:
    """`df` with a struct column `output` of `fields` taken from `column`, each a verbatim quote with `quotes`,
    and `<output>_error` (see `llmops.semantic.extract`)."""
    table, report = llm_extract_table(_eager(df).to_arrow(), column, fields, Llm.of(**kwargs), quotes=quotes,
                                      output=output, gleaning=gleaning)
    return _out(pl.from_arrow(table), report, with_report)


def embed(df: Frame, column: str | Sequence[str], *, output: str = "embedding", **kwargs: Any) -> pl.DataFrame:
    """`df` with the embedding of `column` as a List(Float32) column `output` and `<output>_error` (see
    `llmops.semantic.embed`); kwargs: model, engine_settings, engine."""
    return pl.from_arrow(embed_table(_eager(df).to_arrow(), column, Llm.of(**kwargs), output=output))


def sim_join(left: Frame, right: Frame, *, on: Sequence[str] | str | None = None,
             left_on: Sequence[str] | str | None = None, right_on: Sequence[str] | str | None = None,
             k: int | None = None, threshold: float | None = None, suffix: str = "_right",
             **kwargs: Any) -> pl.DataFrame:
    """Pairs of `left` and `right` rows by embedding similarity: each left row's `k` nearest right rows and/or
    those at or above `threshold`, with `similarity` (see `llmops.semantic.embed`)."""
    lo = left_on if left_on is not None else on
    if lo is None:
        raise ValueError("sim_join: give `on` or `left_on`/`right_on` (the columns to embed)")
    table = sim_join_table(_eager(left).to_arrow(), _eager(right).to_arrow(), Llm.of(**kwargs), left_on=lo,
                           right_on=right_on, k=k, threshold=threshold, suffix=suffix)
    return pl.from_arrow(table)


def split(df: Frame, column: str, *, chunk_size: int, overlap: int = 0, unit: Unit = "chars",
          id_column: str | None = None, **kwargs: Any) -> pl.DataFrame:
    """One row per chunk of `column`: the other columns, `doc_id`, `chunk_index`, `chunk` (see
    `llmops.semantic.split`); unit "tokens" counts with the tokenizer of `model` (kwargs: model,
    engine_settings, engine)."""
    tokenizer = model_tokenizer(Llm.of(**kwargs)) if unit == "tokens" else None
    return pl.from_arrow(split_table(_eager(df).to_arrow(), column, chunk_size=chunk_size, overlap=overlap,
                                     unit=unit, id_column=id_column, tokenizer=tokenizer))


def gather(df: Frame, column: str, *, by: str | Sequence[str] = DOC_ID, order: str = CHUNK_INDEX,
           output: str | None = None, separator: str = "\n", template: str | None = None, schema: Any = None,
           choices: Sequence[str] | None = None, with_report: bool = False, **kwargs: Any) -> Any:
    """One row per document: its chunks' `column` values in `order`, joined by `separator`, or reduced by the
    model with `template` (`{rows}`: the values, one per line; see `llmops.semantic.split`)."""
    constraint = {"schema": schema, "choices": choices, "max_new_tokens": kwargs.pop("max_new_tokens", None)}
    llm = Llm.of(**kwargs) if template is not None else None
    table, report = gather_table(_eager(df).to_arrow(), column, by=by, order=order, output=output,
                                 separator=separator, template=template, llm=llm,
                                 **(constraint if template is not None else {}))
    return _out(pl.from_arrow(table), report, with_report)
