"""The input of `llmops generate`: a text file or stdin (one prompt per line, the column `prompt`), or a
table (CSV, JSONL, Parquet) as a file or on stdin. Text lines end at "\n" only (a trailing "\r" is dropped;
U+2028, form feeds and other Unicode line breaks stay inside their line); blank lines are skipped.

The format is `--format` when given, else a file's suffix, else (stdin) sniffed from the bytes: Parquet's
`PAR1` magic, a first non-blank character `{` (JSONL), or a template naming a column other than `prompt`
(CSV); anything else is text. Tables on stdin are staged to a temporary file and read by DuckDB like any
source, so a file and a pipe give the same column types. An OpenAI batch file (`custom_id` + `body`
lines) without a template is pointed at `llmops batch`.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO

import click
import pyarrow as pa

from llmops.pipeline.sources import read_source
from llmops.pipeline.spec import Source
from llmops.templates import template_fields

TABLE_SUFFIXES = {".csv": "csv", ".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}
FORMATS = ("auto", "text", "csv", "jsonl", "parquet")


def sniff_format(data: bytes, template: str | None) -> str:
    """The format of piped input (see module docstring)."""
    if data.startswith(b"PAR1"):
        return "parquet"
    head = data.lstrip()[:1]
    if head == b"{":
        return "jsonl"
    if template and any(f != "prompt" for f in template_fields(template)):
        return "csv"
    return "text"


def _read_bytes(input_file: str, stdin: BinaryIO) -> bytes:
    if input_file == "-":
        return stdin.read()
    try:
        return Path(input_file).read_bytes()
    except OSError as exc:
        raise click.BadParameter(f"cannot read {input_file}: {exc.strerror}") from None


def _read_table(kind: str, input_file: str, data: bytes | None, limit: int | None) -> pa.Table:
    if data is None:
        return read_source(Source(**{kind: input_file}), limit=limit)
    fd, tmp = tempfile.mkstemp(prefix="llmops-stdin-", suffix=f".{kind}")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        return read_source(Source(**{kind: tmp}), limit=limit)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _is_openai_batch(table: pa.Table) -> bool:
    return {"custom_id", "body"} <= set(table.column_names)


def read_input(input_file: str, template: str | None, stdin: BinaryIO, *, fmt: str = "auto",
               limit: int | None = None) -> tuple[pa.Table, str]:
    """(table, template) for `llmops generate`: a table's rows with `template` (default `{prompt}` when the
    table has a `prompt` column), or the text lines as the column `prompt` with template `{prompt}`.
    click.BadParameter for an unreadable file or a table without a template."""
    if fmt not in FORMATS:
        raise click.BadParameter(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    suffix = Path(input_file).suffix.lower() if input_file != "-" else ""
    data: bytes | None = None
    if fmt == "auto" and suffix in TABLE_SUFFIXES:
        fmt = TABLE_SUFFIXES[suffix]
    if fmt == "auto" and input_file != "-":
        fmt = "text"                       # a file whose suffix is no table's: one prompt per line
    if input_file == "-" or fmt == "text":
        data = _read_bytes(input_file, stdin)
        if fmt == "auto":
            fmt = sniff_format(data, template)
        if input_file != "-":
            data = None if fmt != "text" else data
    if fmt == "text":
        text = (data or b"").decode("utf-8", errors="replace")
        lines = [line.removesuffix("\r") for line in text.split("\n")]   # "\n" only: U+2028, \f stay in their line
        lines = [line for line in lines if line.strip()][:limit]
        return pa.table({"prompt": pa.array(lines, pa.string())}), template or "{prompt}"
    table = _read_table(fmt, input_file, data, limit)
    if template:
        return table, template
    where = "stdin" if input_file == "-" else input_file
    if _is_openai_batch(table):
        raise click.BadParameter(f"{where} looks like an OpenAI batch file (custom_id, body): run "
                                 f"`llmops batch {input_file} -o results.jsonl`")
    if "prompt" in table.column_names:
        return table, "{prompt}"
    raise click.BadParameter(f"{where} is a table ({', '.join(table.column_names)}): give --template with "
                             "{column} placeholders")
