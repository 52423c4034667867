"""Read a pipeline's `source` into an Arrow table (DuckDB does the reading and type inference).

Files are read with DuckDB's `read_csv_auto` / `read_parquet` / `read_json_auto` (paths are bound as
parameters, never spliced into SQL); a `query` runs on an in-memory DuckDB or on `database` (opened
read-only); a `table` is read whole from `database`. A missing file or a failing query raises
`SourceError` naming the source key and the file.
"""
from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa

from llmops.pipeline.spec import Source


class SourceError(ValueError):
    """The source cannot be read (missing file, bad query): a job-level error."""


def quote_ident(name: str) -> str:
    """A DuckDB identifier in double quotes, inner quotes doubled."""
    return '"' + name.replace('"', '""') + '"'


_READERS = {"csv": "read_csv_auto($path)", "parquet": "read_parquet($path)",
            "jsonl": "read_json_auto($path, format = 'newline_delimited')"}


def _effective_limit(source: Source, limit: int | None) -> int | None:
    limits = [n for n in (source.limit, limit) if n is not None]
    return min(limits) if limits else None


def count_source_rows(source: Source, *, limit: int | None = None) -> int:
    """How many rows `read_source` would return (DuckDB counts them: parquet from its metadata)."""
    return int(_query(source, limit, count=True).column(0)[0].as_py())


def read_source(source: Source, *, limit: int | None = None) -> pa.Table:
    """All rows of `source` (at most min(source.limit, limit)), in file/query order."""
    return _query(source, limit)


def _query(source: Source, limit: int | None, count: bool = False) -> pa.Table:
    n = _effective_limit(source, limit)
    tail = f" LIMIT {int(n)}" if n is not None else ""
    if count:
        tail += ") AS counted"
    kind = source.kind
    if kind in _READERS:
        path = getattr(source, kind)
        if not Path(path).exists():
            raise SourceError(f"source.{kind}: file not found: {path}")
        con = duckdb.connect()
        try:
            head = "SELECT count(*) FROM (SELECT * FROM " if count else "SELECT * FROM "
            return con.sql(f"{head}{_READERS[kind]}{tail}", params={"path": path}).to_arrow_table()
        except duckdb.Error as exc:
            raise SourceError(f"source.{kind}: cannot read {path}: {exc}") from None
        finally:
            con.close()
    if source.database is not None and not Path(source.database).exists():
        raise SourceError(f"source.database: file not found: {source.database}")
    con = duckdb.connect(source.database or ":memory:", read_only=source.database is not None)
    try:
        body = source.query.strip().rstrip(";") if kind == "query" else f"SELECT * FROM {quote_ident(source.table or '')}"
        head = "SELECT count(*) FROM (SELECT * FROM " if count else "SELECT * FROM "
        return con.sql(f"{head}({body}){tail}").to_arrow_table()
    except duckdb.Error as exc:
        raise SourceError(f"source.{kind}: {exc}") from None
    finally:
        con.close()
