"""Write a pipeline's rows to its `sink` as they are produced, and publish them atomically at the end.

`SinkWriter.write` appends each finished batch as a Parquet row group to a staging file next to the
target, named for this run (`<target>.llmops-partial-<host>-<pid>-<random>.parquet`, so concurrent runs
to one sink never share it). `commit` has DuckDB sort the staged rows by their hidden row column (so the
sink is in input order whatever order blocks finished in), drop that column, write the target format to a
temporary name of the same kind and rename it into place; a DuckDB table is replaced or appended to in one
transaction. A run that dies before `commit` leaves the previous target untouched; rerunning (the result
cache serves finished rows) produces every row exactly once. `abort` (and a failed commit) removes this
run's staging and temporary files; staging files of dead runs on this host are removed when a writer for
the same sink starts.

Holding a failed run back: `commit(hold=True)` (a run with failed rows, without `--allow-errors`) leaves an
existing target as it was and publishes the rows beside it instead, at `held_target()`: the file
`<name>.llmops-staged<suffix>` (e.g. `out.llmops-staged.parquet`), or the table `<table>_llmops_staged` of
the same database; `held` says where, and a later run replaces it. With no target yet, there is nothing to
hold back and the rows are published as usual.

What may be replaced: only a regular file, or nothing. A target that is a symbolic link (even to a
regular file), a directory, a device (`/dev/full`), a FIFO or a socket is a `SinkError` naming the path,
raised when the writer is made (before any work) and checked again just before publishing. Links are
refused rather than followed: name the file itself as the sink. Making the writer also proves the target's
folder can be written (or created), so an unwritable sink fails before any row is generated.
"""
from __future__ import annotations

import errno
import os
import secrets
import socket
import stat
import tempfile
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from llmops.pids import pid_alive
from llmops.pipeline.sources import quote_ident
from llmops.pipeline.spec import Sink
from llmops.pipeline.steps import ROW_COLUMN

_FORMATS = {"parquet": "FORMAT parquet", "csv": "FORMAT csv, HEADER true", "jsonl": "FORMAT json"}


class SinkError(RuntimeError):
    """The sink cannot be written (bad path, not a regular file, schema change between batches, database
    error)."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
_PARTIAL = ".llmops-partial-"


def check_target(path: Path) -> None:
    """Raise SinkError unless `path` is absent or a regular file (not a link)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):   # nothing there yet (a bad folder fails `check_writable`)
        return
    except OSError as exc:
        raise SinkError(f"sink {path}: cannot inspect it: {exc.strerror}") from None
    if stat.S_ISLNK(mode):
        raise SinkError(f"sink {path} is a symbolic link (to {os.readlink(path)}); llmops replaces only regular "
                        "files and does not write through links: name the file itself as the sink")
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise SinkError(f"sink {path} is {kind}; llmops replaces only regular files")


def check_writable(folder: Path) -> None:
    """SinkError naming `folder` unless files can be created in it, or (when it does not exist yet) it can be
    created: a probe folder is made and removed at once in `folder` or its nearest existing ancestor, so
    nothing is left behind (a dry run creates nothing)."""
    where = folder
    while not os.path.lexists(where) and where != where.parent:
        where = where.parent
    try:
        if not where.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{where} is not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=".llmops-probe-", dir=where))
    except OSError as exc:
        raise SinkError(f"sink: cannot write in folder {folder}: {exc.strerror or exc}") from None


def _remove_stale(folder: Path, prefix: str, host: str) -> None:
    """Delete staging files `<prefix><host>-<pid>-*` of processes of this host that are gone."""
    try:
        names = [p for p in folder.iterdir() if p.name.startswith(f"{prefix}{host}-")]
    except OSError:
        return
    for p in names:
        pid = p.name[len(prefix) + len(host) + 1:].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            p.unlink(missing_ok=True)


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class SinkWriter:
    """Owner of one run's staging file. Call `write` per batch, then `commit` (or `abort` on failure)."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        base = Path(sink.database if sink.kind == "database" else getattr(sink, sink.kind))
        suffix = f".{sink.table}" if sink.kind == "database" else ""
        self.target = base
        check_target(base)
        host = socket.gethostname().replace("-", "_") or "host"
        run = f"{host}-{os.getpid()}-{secrets.token_hex(4)}"
        prefix = f"{base.name}{suffix}{_PARTIAL}"
        _remove_stale(base.parent, prefix, host)
        _remove_stale(base.parent, f"{base.name}.llmops-tmp-", host)     # a run killed while publishing
        self.staging = base.with_name(f"{prefix}{run}.parquet")
        self.tmp = base.with_name(f"{base.name}.llmops-tmp-{run}")
        check_writable(self.staging.parent)
        self.rows = 0
        self.held: str | None = None   # where `commit(hold=True)` published the rows instead of the target
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
        """Drop the staged rows and any temporary file; the target is left as it was."""
        try:
            self._close()
        finally:
            self.staging.unlink(missing_ok=True)
            self.tmp.unlink(missing_ok=True)

    def held_target(self) -> tuple[Path, str | None]:
        """Where `commit(hold=True)` publishes: (file, table) beside the target (see module docstring)."""
        if self.sink.kind == "database":
            return self.target, f"{self.sink.table}_llmops_staged"
        name = self.target.name
        stem, dot, suffix = name.partition(".") if not name.startswith(".") else (name, "", "")
        return self.target.with_name(f"{stem}.llmops-staged{dot}{suffix}" if dot else f"{name}.llmops-staged"), None

    def target_exists(self) -> bool:
        """Whether the target holds something to keep: the file, or the database's table."""
        if self.sink.kind != "database":
            return os.path.lexists(self.target)
        if not self.target.exists():
            return False
        con = duckdb.connect(str(self.target), read_only=True)
        try:
            return bool(con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?",
                                    [self.sink.table]).fetchone()[0])
        except duckdb.Error as exc:
            raise SinkError(f"sink {self.sink.kind} {self.sink.target}: {exc}") from None
        finally:
            con.close()

    def commit(self, *, hold: bool = False) -> int:
        """Publish the staged rows in row order to the target (with `hold` and an existing target: beside it,
        see module docstring); return the number of rows written."""
        if self._writer is None:
            raise SinkError("sink: nothing was written (not even an empty batch)")
        self._close()
        select = (f"SELECT * EXCLUDE ({quote_ident(ROW_COLUMN)}) FROM read_parquet({_literal(str(self.staging))}) "
                  f"ORDER BY {quote_ident(ROW_COLUMN)}")
        target, table = self.target, self.sink.table
        if hold and self.target_exists():
            target, table = self.held_target()
            self.held = f"{target} (table {table})" if table else str(target)
        try:
            check_target(target)
            if self.sink.kind == "database":
                self._commit_table(select, table or "", replace=self.held is not None)
            else:
                con = duckdb.connect()
                try:
                    con.execute(f"COPY ({select}) TO {_literal(str(self.tmp))} ({_FORMATS[self.sink.kind]})")
                finally:
                    con.close()
                check_target(target)
                os.replace(self.tmp, target)
        except duckdb.Error as exc:
            self.tmp.unlink(missing_ok=True)
            raise SinkError(f"sink {self.sink.kind} {self.sink.target}: {exc}") from None
        except OSError as exc:
            self.tmp.unlink(missing_ok=True)
            raise SinkError(f"sink {self.sink.kind} {self.sink.target}: {exc.strerror or exc}") from None
        except SinkError:
            self.tmp.unlink(missing_ok=True)
            raise
        self.staging.unlink(missing_ok=True)
        return self.rows

    def _commit_table(self, select: str, name: str, *, replace: bool = False) -> None:
        table = quote_ident(name)
        con = duckdb.connect(str(self.target))
        try:
            con.execute("BEGIN TRANSACTION")
            if self.sink.mode == "replace" or replace:
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
