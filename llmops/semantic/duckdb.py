"""DuckDB spellings of the semantic operators: functions over relations (like `llmops.duckdb.map_relation`)
and a boolean SQL macro for filtering.

    register_filter(con, "is_bug", "Is this ticket a bug report? {body}")
    con.sql("SELECT * FROM tickets WHERE is_bug(body)")                 # one job per registered function
    llm_filter(con, "SELECT * FROM tickets", "Is this a bug report? {body}", reason="why")
    llm_join(con, "SELECT * FROM shop_a", "SELECT * FROM shop_b", on=["title"])
    resolve(con, "SELECT * FROM customers", on=["name", "city"], blocking={"keys": ["phone"]})
    llm_reduce(con, "SELECT * FROM tickets", by=["label"], template="Summarise:\\n{rows}")
    llm_topk(con, "SELECT * FROM tickets", "Which {subject} is the most urgent?", k=5)
    llm_extract(con, "SELECT * FROM invoices", "body", {"invoice_number": "the invoice number"})
    embed(con, "SELECT * FROM tickets", "subject")
    sim_join(con, "SELECT * FROM a", "SELECT * FROM b", on="title", k=1)
    split(con, "SELECT * FROM docs", "text", chunk_size=2000, overlap=200)
    gather(con, "SELECT * FROM notes", "note")

Each takes a query (SQL text or a relation) and returns a relation once every row is done; column arguments
(`on`, `right_on`, `by`) take one name or a list of names; keyword
arguments are those of `llmops.semantic.options.Llm.of`. DuckDB's Python API has no table functions, so a
relation function is the natural form for whole-table operators; `register_filter` builds on
`llmops.duckdb.register` (a Yes/No `llm_map`) and compares its answer, so NULL in gives NULL (not kept).
Nothing here imports Polars.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import duckdb
import pyarrow as pa

from llmops import duckdb as llm_duckdb
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
from llmops.templates import template_fields

Query = str | duckdb.DuckDBPyRelation


def _table(con: duckdb.DuckDBPyConnection, query: Query) -> pa.Table:
    return (con.sql(query) if isinstance(query, str) else query).to_arrow_table()


def _names(value: str | Sequence[str]) -> list[str]:
    """Column names given as one name or a list of names."""
    return [value] if isinstance(value, str) else list(value)


def _blocking(blocking: AnyBlocking | Mapping[str, Any] | str | None) -> AnyBlocking:
    return as_blocking(blocking)


def register_filter(con: duckdb.DuckDBPyConnection, name: str, template: str, **kwargs: Any) -> str:
    """Create SQL macro `name(<placeholders>) -> BOOLEAN`: the model's Yes to `template`. kwargs: those of
    `llmops.duckdb.register`."""
    kwargs.setdefault("system", semantic_filter.SYSTEM)
    kwargs.setdefault("max_new_tokens", 4)
    inner = llm_duckdb.register(con, name=f"__llmops_{name}_answer", template=template,
                                choices=[semantic_filter.YES, semantic_filter.NO], **kwargs)
    args = ", ".join(f'"{a}"' for a in template_fields(template))
    con.execute(f"CREATE OR REPLACE MACRO {name}({args}) AS {inner}({args}) = '{semantic_filter.YES}'")
    return name


def llm_filter(con: duckdb.DuckDBPyConnection, query: Query, template: str, *, reason: str | None = None,
               **kwargs: Any) -> duckdb.DuckDBPyRelation:
    """The rows of `query` the model keeps (with its reason in column `reason` when named)."""
    table = semantic_filter.llm_filter_table(_table(con, query), template, Llm.of(**kwargs), reason_column=reason)
    return con.from_arrow(table)


def llm_join(con: duckdb.DuckDBPyConnection, left: Query, right: Query, *, on: str | Sequence[str],
             right_on: str | Sequence[str] | None = None, blocking: AnyBlocking | Mapping[str, Any] | str | None = None,
             template: str | None = None, min_confidence: float = 0.5, **kwargs: Any) -> duckdb.DuckDBPyRelation:
    """Matched pairs of two queries (see `llmops.semantic.join`)."""
    table, _ = llm_join_table(_table(con, left), _table(con, right), Llm.of(**kwargs), left_on=_names(on),
                              right_on=_names(right_on) if right_on is not None else None,
                              blocking=_blocking(blocking), template=template, min_confidence=min_confidence)
    return con.from_arrow(table)


def resolve(con: duckdb.DuckDBPyConnection, query: Query, *, on: str | Sequence[str],
            blocking: AnyBlocking | Mapping[str, Any] | str | None = None, template: str | None = None,
            output: str = "entity_id", id_column: str | None = None, **kwargs: Any) -> duckdb.DuckDBPyRelation:
    """`query`'s rows with an entity id column (see `llmops.semantic.resolve`)."""
    table, _ = resolve_table(_table(con, query), _names(on), Llm.of(**kwargs), blocking=_blocking(blocking),
                             template=template, output=output, id_column=id_column)
    return con.from_arrow(table)


def llm_reduce(con: duckdb.DuckDBPyConnection, query: Query, *, by: str | Sequence[str], template: str,
               item: str | None = None, output: str = "output", schema: Any = None,
               choices: Sequence[str] | None = None, max_prompt_tokens: int | None = None,
               **kwargs: Any) -> duckdb.DuckDBPyRelation:
    """One row per group of `by` (see `llmops.semantic.reduce`)."""
    constraint = {"schema": schema, "choices": choices,
                  "max_new_tokens": kwargs.pop("max_new_tokens", None)}
    table, _ = llm_reduce_table(_table(con, query), _names(by), template, Llm.of(**kwargs), item=item, output=output,
                                max_prompt_tokens=max_prompt_tokens, **constraint)
    return con.from_arrow(table)


def llm_topk(con: duckdb.DuckDBPyConnection, query: Query, template: str, *, k: int, rank: str = "rank",
             seed: int = 0, **kwargs: Any) -> duckdb.DuckDBPyRelation:
    """The `k` rows of `query` that best answer `template`'s question, best first (see `llmops.semantic.topk`)."""
    table, _ = llm_topk_table(_table(con, query), template, k, Llm.of(**kwargs), rank=rank, seed=seed)
    return con.from_arrow(table)


def llm_extract(con: duckdb.DuckDBPyConnection, query: Query, column: str, fields: Sequence[str] | Mapping[str, str],
                *, quotes: bool = True, output: str = "extracted", gleaning: int = 1,
                **kwargs: Any) -> duckdb.DuckDBPyRelation:
    """`query`'s rows with a STRUCT of `fields` quoted from `column` (see `llmops.semantic.extract`)."""
    table, _ = llm_extract_table(_table(con, query), column, fields, Llm.of(**kwargs), quotes=quotes, output=output,
                                 gleaning=gleaning)
    return con.from_arrow(table)


def embed(con: duckdb.DuckDBPyConnection, query: Query, column: str | Sequence[str], *, output: str = "embedding",
          **kwargs: Any) -> duckdb.DuckDBPyRelation:
    """`query`'s rows with a FLOAT[] embedding of `column` (see `llmops.semantic.embed`)."""
    return con.from_arrow(embed_table(_table(con, query), _names(column), Llm.of(**kwargs), output=output))


def sim_join(con: duckdb.DuckDBPyConnection, left: Query, right: Query, *, on: str | Sequence[str],
             right_on: str | Sequence[str] | None = None, k: int | None = None, threshold: float | None = None,
             suffix: str = "_right", **kwargs: Any) -> duckdb.DuckDBPyRelation:
    """Pairs of two queries' rows by embedding similarity (see `llmops.semantic.embed`)."""
    table = sim_join_table(_table(con, left), _table(con, right), Llm.of(**kwargs), left_on=_names(on),
                           right_on=_names(right_on) if right_on is not None else None, k=k, threshold=threshold,
                           suffix=suffix)
    return con.from_arrow(table)


def split(con: duckdb.DuckDBPyConnection, query: Query, column: str, *, chunk_size: int, overlap: int = 0,
          unit: Unit = "chars", id_column: str | None = None, **kwargs: Any) -> duckdb.DuckDBPyRelation:
    """One row per chunk of `column` (see `llmops.semantic.split`)."""
    tokenizer = model_tokenizer(Llm.of(**kwargs)) if unit == "tokens" else None
    return con.from_arrow(split_table(_table(con, query), column, chunk_size=chunk_size, overlap=overlap, unit=unit,
                                      id_column=id_column, tokenizer=tokenizer))


def gather(con: duckdb.DuckDBPyConnection, query: Query, column: str, *, by: str | Sequence[str] = DOC_ID,
           order: str = CHUNK_INDEX, output: str | None = None, separator: str = "\n", template: str | None = None,
           **kwargs: Any) -> duckdb.DuckDBPyRelation:
    """One row per document, its chunks' `column` values joined or reduced (see `llmops.semantic.split`)."""
    constraint = {k: kwargs.pop(k) for k in ("schema", "choices", "max_new_tokens") if k in kwargs}
    table, _ = gather_table(_table(con, query), column, by=by, order=order, output=output, separator=separator,
                            template=template, llm=Llm.of(**kwargs) if template is not None else None, **constraint)
    return con.from_arrow(table)
