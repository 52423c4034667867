"""`llmops generate`: one-off generation for a prompt given as text, the lines of a text file or stdin, or a
template over a table (`llmops.pipeline.oneoff.generate` does the work).

The argument is a file when a file of that name exists (or `-`, stdin, the default); otherwise it is the
prompt itself: `llmops generate "Name three colours"`. A name that looks like a file (a `.txt`, `.csv`,
`.jsonl`, `.ndjson`, `.json` or `.parquet` suffix, no spaces) and does not exist is a missing-file error, not
a prompt. `-p/--prompt TEXT` (repeatable) always means prompt text. Prompt text is the row's `{prompt}`, data
like any cell (a `--template` may wrap it: `-t "Translate to French: {prompt}"`).

Exit codes as the rest of the CLI: 0 success; 1 rows failed (unless `--allow-errors`) or the engine failed;
2 invalid input (a bad option, a missing file or column, a template error).
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

from llmops.cli_common import want_progress
from llmops.pipeline.load import PipelineError
from llmops.pipeline.oneoff import generate
from llmops.pipeline.sources import SourceError
from llmops.pipeline.steps import StepError
from llmops.templates import TemplateError

EXIT_FAILED, EXIT_INVALID = 1, 2
FILE_SUFFIXES = (".txt", ".csv", ".jsonl", ".ndjson", ".json", ".parquet")


def _fail(message: str, code: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def split_input(value: str, prompts: tuple[str, ...]) -> tuple[str, list[str] | None]:
    """(input file, prompt texts or None) from the argument and `--prompt`s (see module docstring).
    click.BadParameter for a missing file named like one, or for a file and prompts given together."""
    is_file = value == "-" or Path(value).exists()
    looks_like_file = not any(c.isspace() for c in value) and Path(value).suffix.lower() in FILE_SUFFIXES
    if not is_file and looks_like_file:
        raise click.BadParameter(f"no such file: {value} (to send it as a prompt, use --prompt {value!r})")
    if prompts:
        if value != "-":
            raise click.BadParameter(f"give prompts with --prompt or an input {value!r}, not both")
        return "-", list(prompts)
    return (value, None) if is_file else ("-", [value])


@click.command("generate")
@click.argument("input_or_prompt", default="-", metavar="[INPUT_FILE | PROMPT]")
@click.option("--prompt", "-p", "prompts", multiple=True, metavar="TEXT",
              help="A prompt as text (repeatable: one row each), instead of an input file.")
@click.option("--template", "-t", help="Prompt template with {column} placeholders (CSV/Parquet/JSONL input); "
              "for text input and prompts the text is {prompt}.")
@click.option("--model", "-m", default="smollm2-135m-instruct", show_default=True, help="Model name or path.")
@click.option("--system", help="System prompt.")
@click.option("--schema", help="JSON schema (or {field: type} shorthand) as JSON text, or @file.json.")
@click.option("--choices", help="Comma-separated list: the answer is exactly one of them.")
@click.option("--regex", help="The answer matches this regex (constrained decoding).")
@click.option("--id", "id_column", metavar="COLUMN", help="Carry this input column into each --jsonl line.")
@click.option("--limit", type=click.IntRange(min=0), help="Read at most N input rows.")
@click.option("--format", "fmt", type=click.Choice(["auto", "text", "csv", "jsonl", "parquet"]), default="auto",
              show_default=True, help="Input format (auto: the file's suffix; on stdin, sniffed from the data).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--output", "-o", "output", type=click.Path(dir_okay=False), help="Write a table (.csv/.parquet/.jsonl) "
              "with the input columns and `output` instead of printing.")
@click.option("--jsonl", is_flag=True, help="Print one JSON object per row (row, output, finish_reason, error).")
@click.option("--no-cache", is_flag=True, help="Do not use the result cache.")
@click.option("--allow-errors", is_flag=True, help="Exit 0 even when some rows failed (their values are null).")
@click.option("--progress/--no-progress", default=None,
              help="Show a progress bar (default: when stderr is a terminal).")
def generate_cmd(input_or_prompt: str, prompts: tuple[str, ...], template: str | None, model: str,
                 system: str | None, schema: str | None, choices: str | None, regex: str | None,
                 id_column: str | None, limit: int | None, fmt: str, max_new_tokens: int, temperature: float,
                 output: str | None, jsonl: bool, no_cache: bool, allow_errors: bool, progress: bool | None) -> None:
    """One-off generation: a prompt given as text, one prompt per line of a text file (or stdin), or a template
    over a table (CSV, JSONL or Parquet; a file or stdin).

    \b
    Examples:
      llmops generate "Name three colours"
      llmops generate "Is this spam? Win a free cruise" --choices yes,no
      llmops generate -p "Say hi" -p "Say bye" --jsonl
      printf 'Say hi\\nName a colour\\n' | llmops generate
      llmops generate sample_data/tickets.csv -t "Classify: {subject}" --choices bug,billing,other --id id --jsonl
      llmops generate sample_data/invoices.csv -t "Invoice number in: {body}" -o out/numbers.parquet
    """
    try:
        input_file, texts = split_input(input_or_prompt, prompts)
        failed = generate(input_file, template=template, model=model, system=system, schema=schema, choices=choices,
                          max_new_tokens=max_new_tokens, temperature=temperature, output=output, jsonl=jsonl,
                          use_cache=not no_cache, progress=want_progress(progress), regex=regex,
                          id_column=id_column, limit=limit, fmt=fmt, prompts=texts)
    except (PipelineError, SourceError, StepError, TemplateError, click.BadParameter) as exc:
        _fail(str(exc), EXIT_INVALID)
    except Exception as exc:  # noqa: BLE001 (any engine failure is reported, not a traceback)
        _fail(f"{type(exc).__name__}: {exc}", EXIT_FAILED)
    if failed and not allow_errors:
        _fail(f"{failed} row(s) failed (null values); pass --allow-errors to exit 0", EXIT_FAILED)
