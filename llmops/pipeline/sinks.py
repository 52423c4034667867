"""Write a pipeline's rows to its `sink` as they are produced, and publish them atomically at the end.

`SinkWriter.write` appends each finished batch as a Parquet row group to a staging file next to the
target (`<target>.llmops-partial.parquet`, restarted by every run). `commit` has DuckDB sort the staged
rows by their hidden row column (so the sink is in input order whatever order blocks finished in), drop
that column, write the target format to a temporary name and rename it into place; a DuckDB table is
replaced or appended to in one transaction. A run that dies before `commit` leaves the previous target
untouched; rerunning (the result cache serves finished rows) produces every row exactly once.
"""
from __future__ import annotations

import os
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from llmops.pipeline.sources import quote_ident
from llmops.pipeline.spec import Sink
from llmops.pipeline.steps import ROW_COLUMN

_FORMATS = {"parquet": "FORMAT parquet", "csv": "FORMAT csv, HEADER true", "jsonl": "FORMAT json"}


class SinkError(RuntimeError):
    """The sink cannot be written (bad path, schema change between batches, database error)."""


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class SinkWriter:
    """Owner of one run's staging file. Call `write` per batch, then `commit` (or `abort` on failure)."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        base = Path(sink.database if sink.kind == "database" else getattr(sink, sink.kind))
        suffix = f".{sink.table}" if sink.kind == "database" else ""
        self.target = base
        self.staging = base.with_name(f"{base.name}{suffix}.llmops-partial.parquet")
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._schema: pa.Schema | None = None

    def write(self, table: pa.Table) -> None:
        """Append rows (must carry `ROW_COLUMN`) as one row group; durable once `commit` returns."""
        if ROW_COLUMN not in table.column_names:
            raise SinkError(f"sink: rows lack the {ROW_COLUMN} column")
        if self._writer is None:
            try:
                self.staging.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise SinkError(f"sink: cannot create folder {self.staging.parent}: {exc.strerror}") from None
            self._schema = table.schema
            self._writer = pq.ParquetWriter(self.staging, table.schema)
        if table.schema != self._schema:
            try:
                table = table.cast(self._schema)
            except (pa.ArrowInvalid, ValueError) as exc:
                raise SinkError(f"sink: batch schema {table.schema} differs from the first batch's "
                                f"{self._schema}: {exc}") from None
        self._writer.write_table(table)
        self.rows += table.num_rows

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def abort(self) -> None:
        """Drop the staged rows; the target is left as it was."""
        self._close()
        self.staging.unlink(missing_ok=True)

    def commit(self) -> int:
        """Publish the staged rows in row order to the target; return the number of rows written."""
        if self._writer is None:
            raise SinkError("sink: nothing was written (not even an empty batch)")
        self._close()
        select = (f"SELECT * EXCLUDE ({quote_ident(ROW_COLUMN)}) FROM read_parquet({_literal(str(self.staging))}) "
                  f"ORDER BY {quote_ident(ROW_COLUMN)}")
        try:
            if self.sink.kind == "database":
                self._commit_table(select)
            else:
                tmp = self.target.with_name(self.target.name + ".llmops-tmp")
                con = duckdb.connect()
                try:
                    con.execute(f"COPY ({select}) TO {_literal(str(tmp))} ({_FORMATS[self.sink.kind]})")
                finally:
                    con.close()
                os.replace(tmp, self.target)
        except duckdb.Error as exc:
            raise SinkError(f"sink {self.sink.kind} {self.sink.target}: {exc}") from None
        self.staging.unlink(missing_ok=True)
        return self.rows

    def _commit_table(self, select: str) -> None:
        table = quote_ident(self.sink.table or "")
        con = duckdb.connect(str(self.target))
        try:
            con.execute("BEGIN TRANSACTION")
            if self.sink.mode == "replace":
                con.execute(f"CREATE OR REPLACE TABLE {table} AS {select}")
            else:
                con.execute(f"CREATE TABLE IF NOT EXISTS {table} AS SELECT * FROM ({select}) LIMIT 0")
                con.execute(f"INSERT INTO {table} BY NAME {select}")
            con.execute("COMMIT")
        except duckdb.Error:
            try:
                con.execute("ROLLBACK")
            except duckdb.Error:
                pass
            raise
        finally:
            con.close()
