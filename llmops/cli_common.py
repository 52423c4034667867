"""What every `llmops` command shares about talking to the user: logging levels (`-v`, `-vv`, `-q`) and
the quiet switch. Results go to stdout; diagnostics (summaries, progress, log records) to stderr.

Levels: default WARNING; `-v` INFO (planning, cache, engine notes); `-vv` DEBUG; `-q` ERROR, no progress
bars and no summary lines (errors are still printed, exit codes are unchanged).
"""
from __future__ import annotations

import logging
import sys

import click

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def configure(verbose: int, quiet: bool) -> None:
    """Set the root logger's level and its stderr handler for this invocation (replacing earlier ones)."""
    level = logging.ERROR if quiet else (logging.WARNING, logging.INFO)[min(verbose, 1)] if verbose < 2 \
        else logging.DEBUG
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr, force=True)
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.ensure_object(dict)["quiet"] = quiet


def is_quiet() -> bool:
    """Whether the current invocation runs with `-q` (False outside a click command)."""
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    return bool(root is not None and isinstance(root.obj, dict) and root.obj.get("quiet"))


def note(message: str) -> None:
    """A diagnostic line on stderr (a summary, a hint), unless quiet."""
    if not is_quiet():
        click.echo(message, err=True)


def want_progress(progress: bool | None) -> bool | None:
    """`--progress/--no-progress` as given; with `-q` and neither given, no bar."""
    return False if progress is None and is_quiet() else progress
