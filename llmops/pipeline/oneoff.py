"""What `llmops generate` and `llmops models` do, kept out of the click layer.

`generate` maps a template over a table (CSV/Parquet/JSONL, a file or stdin), over the lines of a text
file / stdin (each line is the column `prompt`; `llmops.pipeline.inputs`) or over prompts given as text,
then prints one result per row or writes a table.
`list_all_models` gathers the engine's aliases and presets plus model files found in local folders.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import click
import pyarrow as pa

from llmops import core
from llmops.cli_common import note
from llmops.core import MapSpec, map_table
from llmops.pipeline.inputs import TABLE_SUFFIXES, read_input
from llmops.pipeline.sinks import SinkWriter
from llmops.pipeline.spec import LlmMap, Sink, check_regex, schema_from_shorthand
from llmops.pipeline.steps import attach_output
from llmops.templates import TemplateError


def _schema(text: str | None) -> dict | None:
    if text is None:
        return None
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text(encoding="utf-8")
        except OSError as exc:
            raise click.BadParameter(f"--schema {text}: {exc.strerror}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"--schema is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise click.BadParameter("--schema must be a JSON object")
    return schema_from_shorthand(value)


def _line(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value.replace("\\", "\\\\").replace("\n", "\\n")
    return json.dumps(value, ensure_ascii=False, default=str)


def _binary(stdin: TextIO | BinaryIO) -> BinaryIO:
    buffer = getattr(stdin, "buffer", None)
    if buffer is not None:
        return buffer
    if isinstance(stdin.read(0), bytes):
        return stdin  # type: ignore[return-value]
    raise TypeError("stdin must be binary or have a .buffer")


def generate(input_file: str, *, template: str | None, model: str, system: str | None, schema: str | None,
             choices: str | None, max_new_tokens: int, temperature: float, output: str | None, jsonl: bool,
             use_cache: bool, progress: bool | None, stdin: TextIO | BinaryIO | None = None,
             engine: Any = None, regex: str | None = None, id_column: str | None = None,
             limit: int | None = None, fmt: str = "auto", prompts: Sequence[str] | None = None) -> int:
    """Run one template over the input (`llmops.pipeline.inputs.read_input`: text lines, CSV, JSONL,
    Parquet, a file or stdin; or `prompts`, texts given on the command line, as the column `prompt`; at most
    `limit` rows); print one line per row in input order (with `jsonl`,
    an object with `id_column`'s value when given, row, output, finish_reason, error) or write `output`.
    Returns the number of failed rows; job-level problems raise (click.BadParameter, TemplateError...)."""
    constraints = [n for n, v in (("--schema", schema), ("--choices", choices), ("--regex", regex)) if v]
    if len(constraints) > 1:
        raise click.BadParameter(f"give at most one of --schema, --choices, --regex (got {', '.join(constraints)})")
    try:
        check_regex(regex)
    except ValueError as exc:
        raise click.BadParameter(f"--regex: {exc}") from None
    check_can_generate(model)
    if prompts is not None:
        table, template = pa.table({"prompt": pa.array(list(prompts)[:limit], pa.string())}), template or "{prompt}"
    else:
        table, template = read_input(input_file, template, _binary(stdin or sys.stdin), fmt=fmt, limit=limit)
    if id_column is not None and id_column not in table.column_names:
        raise click.BadParameter(f"--id {id_column!r} is not a column of the input; available columns: "
                                 f"{', '.join(table.column_names)}")
    try:
        spec = MapSpec(template=template, model=model, system=system, schema=_schema(schema),
                       choices=tuple(c.strip() for c in choices.split(",")) if choices is not None else None,
                       regex=regex, max_new_tokens=max_new_tokens, temperature=temperature)
    except TemplateError:
        raise
    except ValueError as exc:   # a NaN temperature, repeated or empty choices: the options are invalid (exit 2)
        raise click.BadParameter(str(exc)) from None
    writer = None
    if output is not None:  # checked before any work: the name, and what is at that path (SinkError)
        suffix = Path(output).suffix.lower()
        if suffix not in TABLE_SUFFIXES:
            raise click.BadParameter(f"--output {output}: use a .csv, .parquet or .jsonl name")
        writer = SinkWriter(Sink(**{TABLE_SUFFIXES[suffix]: output}))
    run = map_table(table, spec, cache_dir=None if use_cache else False, progress=progress, engine=engine)
    results = run.ordered()
    if writer is not None:
        try:
            writer.write(attach_output(table, results, LlmMap(output="output", template=template)))
            writer.commit()
        except BaseException:
            writer.abort()
            raise
    else:
        ids = table.column(id_column).to_pylist() if id_column is not None else None
        for rec in results.to_pylist():
            head = {id_column: ids[rec["row"]]} if ids is not None else {}
            click.echo(json.dumps({**head, **{k: rec[k] for k in ("row", "output", "finish_reason", "error")}},
                                  ensure_ascii=False, default=str) if jsonl else _line(rec["output"]))
    failed = run.summary.errors + run.summary.truncated
    note(str(run.summary))
    return failed


def _local_models(folder: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if not folder.is_dir():
        return rows
    for p in sorted(folder.expanduser().iterdir()):
        if p.is_dir() and (p / "config.json").exists():
            size = sum(f.stat().st_size for f in p.glob("*.safetensors"))
            rows.append({"name": str(p), "kind": "folder", "available": True, "bytes": size or None})
        elif p.suffix == ".gguf":
            rows.append({"name": str(p), "kind": "gguf", "available": True, "bytes": p.stat().st_size})
    return rows


def _uses(row: dict[str, Any]) -> str:
    """What an entry can do: "generate" (weights and a tokenizer) or "benchmark" (a dummy-weight preset:
    no tokenizer, for `llmops policy` and the benchmarks)."""
    return "benchmark" if row.get("kind") == "preset" else "generate"


def list_all_models(dirs: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    """Aliases and presets from the engine, then local models under `dirs` and `$LLMOPS_MODELS_DIR`; each
    row says what it can do (`uses`: "generate" or "benchmark")."""
    rows = core.engine_models()
    folders = list(dirs) + ([Path(os.environ["LLMOPS_MODELS_DIR"])] if os.environ.get("LLMOPS_MODELS_DIR") else [])
    for folder in folders:
        rows.extend(_local_models(Path(folder).expanduser()))
    return [{**r, "uses": _uses(r)} for r in rows]


def check_can_generate(model: str, *, option: str = "--model") -> None:
    """click.BadParameter when `model` is a benchmark-only preset (dummy weights, no tokenizer), before any
    work; anything else (an alias, a folder, a file) is left to the engine."""
    preset = next((r for r in core.engine_models() if r.get("name") == model and r.get("kind") == "preset"), None)
    if preset is not None:
        usable = ", ".join(r["name"] for r in core.engine_models() if r.get("kind") != "preset" and r.get("available"))
        raise click.BadParameter(f"{option} {model}: a benchmark-only preset (dummy weights, no tokenizer) cannot "
                                 f"generate text; use a model that can ({usable or 'a Hugging Face folder or .gguf'}"
                                 f"; `llmops models` lists them), or `llmops policy --model {model}` to plan it")


def _count(n: float | None) -> str:
    """135M, 6.86B: a parameter count."""
    if not n:
        return "-"
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(int(n))


def _bytes(n: float | None) -> str:
    """313MiB, 12.8GiB: a size in binary units."""
    if not n:
        return "-"
    for suffix, scale in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{int(n)}B"


def models_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table: name, kind, what it can do, parameters, size, availability and a note."""
    table = [("NAME", "KIND", "USE", "PARAMS", "SIZE", "AVAILABLE", "NOTE")]
    for r in rows:
        note = r.get("install") or r.get("description") or r.get("architecture") or ""
        if r.get("kind") == "preset":
            note = f"{note}, no tokenizer: llmops policy and benchmarks only"
        use = r.get("uses") or _uses(r)
        table.append((str(r.get("name")), str(r.get("kind", "")), use, _count(r.get("params")),
                      _bytes(r.get("bytes")), "yes" if r.get("available") else "no", str(note)))
    widths = [max(len(row[i]) for row in table) for i in range(6)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:6], widths)) + "  " + row[6] for row in table)
