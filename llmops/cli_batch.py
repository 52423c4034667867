"""`llmops batch`: an OpenAI / vLLM batch request file in, a batch output file out (llmops.openai_batch).

Exit codes as the rest of the CLI: 0 every line answered; 1 some lines carry an error (unless
`--allow-errors`) or the output could not be published; 2 the command line is invalid (missing input, bad
--set, an output path that cannot be written: checked before any work). A bad request line or a failed
job gives error lines, never a lost batch. The output file is staged beside the target as lines finish and
renamed into place, in input order, when every line is done (`llmops.batch_output`).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
import yaml
from pydantic import ValidationError

from llmops.batch_output import OutputError, StagedOutput, json_line
from llmops.cli_common import note, want_progress
from llmops.openai_batch import DEFAULT_MAX_TOKENS, run_batch
from llmops.pipeline.oneoff import check_can_generate
from llmops.pipeline.spec import EngineSettings

EXIT_FAILED, EXIT_INVALID = 1, 2


def engine_overrides(items: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    """`engine.KEY=VALUE` items as validated engine settings; click.BadParameter names a bad or unknown key."""
    known = sorted(EngineSettings.model_fields)
    values: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        name = key.removeprefix("engine.")
        if not sep or not key.startswith("engine.") or name not in known:
            raise click.BadParameter(f"--set {item!r}: unknown key {key!r}; known: "
                                     f"{', '.join('engine.' + k for k in known)}")
        values[name] = yaml.safe_load(raw)
    try:
        return tuple(sorted(EngineSettings(**values).llm_kwargs().items()))
    except ValidationError as exc:
        err = exc.errors()[0]
        raise click.BadParameter(f"--set engine.{err['loc'][0]}: {err['msg']}") from None


def _read_lines(input_file: str) -> list[str]:
    """The request file's lines (split at "\n" only, a trailing "\r" dropped); BadParameter when unreadable."""
    try:
        text = sys.stdin.read() if input_file == "-" else Path(input_file).read_text(encoding="utf-8")
    except OSError as exc:
        raise click.BadParameter(f"cannot read {input_file}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise click.BadParameter(f"{input_file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return [line.removesuffix("\r") for line in text.split("\n")]


@click.command("batch")
@click.argument("input_file", type=click.Path(allow_dash=True, path_type=str))
@click.option("--output", "-o", default="-", show_default=True, type=click.Path(allow_dash=True, dir_okay=False),
              help="Batch output file (JSONL), '-' for stdout.")
@click.option("--model", "-m", default="smollm2-135m-instruct", show_default=True,
              help="Model serving every line (the lines' own `model` is not used).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=DEFAULT_MAX_TOKENS, show_default=True,
              help="max_tokens for lines that give none.")
@click.option("--limit", type=click.IntRange(min=0), help="Run only the first N request lines.")
@click.option("--set", "overrides", multiple=True, metavar="engine.KEY=VALUE",
              help="Engine setting, e.g. --set engine.gpu_memory=24GiB --set engine.device=cuda.")
@click.option("--no-cache", is_flag=True, help="Neither read nor fill the result cache.")
@click.option("--allow-errors", is_flag=True, help="Exit 0 even when some lines carry an error.")
@click.option("--progress/--no-progress", default=None, help="Show a progress bar (default: when stderr is a terminal).")
def batch_cmd(input_file: str, output: str, model: str, max_tokens: int, limit: int | None,
              overrides: tuple[str, ...], no_cache: bool, allow_errors: bool, progress: bool | None) -> None:
    """Run an OpenAI batch file (the format of OpenAI's Batch API and vLLM's run_batch).

    Each input line is {"custom_id", "method": "POST", "url": "/v1/chat/completions" or "/v1/completions",
    "body": {...}}; each output line {"id", "custom_id", "response": {"status_code", "request_id", "body"},
    "error"}, in input order. response_format, guided_* and structured_outputs become constrained decoding.
    Every line is checked before any work: a bad line (unknown field, NaN, a schema or regex that does not
    compile, a repeated custom_id) gets an error line naming its line number and field, and the others run.
    Requests with equal sampling parameters run as one job; finished lines stay in the result cache.

    \b
    Examples:
      llmops batch sample_data/batch_requests.jsonl -o out/batch_results.jsonl
      llmops batch requests.jsonl --model /models/Llama-3-8B-Instruct --set engine.gpu_memory=24GiB > results.jsonl
    """
    staged = None
    try:
        settings = engine_overrides(overrides)
        check_can_generate(model)
        lines = _read_lines(input_file)
        staged = StagedOutput(Path(output)) if output != "-" else None
    except (click.BadParameter, OutputError) as exc:
        click.echo(f"error: {exc.message if isinstance(exc, click.BadParameter) else exc}", err=True)
        sys.exit(EXIT_INVALID)
    try:
        result = run_batch(lines, model=model, engine_settings=settings, default_max_tokens=max_tokens, limit=limit,
                           cache_dir=False if no_cache else None, progress=want_progress(progress),
                           on_line=staged.add if staged is not None else None)
        if staged is not None:
            staged.publish()
        else:
            click.echo("".join(json_line(o) for o in result.lines), nl=False)
    except OutputError as exc:   # the target could not be published; the message names the staged answers
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_FAILED)
    except Exception as exc:  # noqa: BLE001 (a failure is reported, not a traceback)
        kept = f"; the answers so far are in {staged.keep()}" if staged is not None else ""
        click.echo(f"error: {type(exc).__name__}: {exc}{kept}", err=True)
        sys.exit(EXIT_FAILED)
    s = result.summary
    note(f"{len(result.lines)} lines, {result.failed} with errors, {result.jobs} job(s); {s}"
         + (f"; output: {output}" if output != "-" else ""))
    if result.failed and not allow_errors:
        click.echo(f"{result.failed} line(s) failed (their `error` says why); pass --allow-errors to exit 0", err=True)
        sys.exit(EXIT_FAILED)
