"""What every `llmops` command shares about talking to the user: logging levels (`-v`, `-vv`, `-q`) and
the quiet switch. Results go to stdout; diagnostics (summaries, progress, log records) to stderr.

Levels: default WARNING; `-v` INFO from llmops and the engine (the plan and where it places weights, cache and
activations, rows to generate, each block's rows, time and tokens); `-vv` DEBUG (every decode step too); `-q`
ERROR, no progress bars and no summary lines (errors are still printed, exit codes are unchanged). Other
libraries' loggers stay at WARNING, so `-vv` is not drowned in their debug output.
"""
from __future__ import annotations

import logging
import sys

import click

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
OWN_LOGGERS = ("llmops", "engine")


def log_level(verbose: int, quiet: bool) -> int:
    """The level of llmops' and the engine's loggers for `-v` given `verbose` times, or `-q`."""
    if quiet:
        return logging.ERROR
    return (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)]


def configure(verbose: int, quiet: bool) -> None:
    """Set the loggers' levels and the root logger's stderr handler for this invocation (replacing earlier
    ones): `OWN_LOGGERS` at `log_level`, every other logger at WARNING (ERROR with `-q`)."""
    level = log_level(verbose, quiet)
    logging.basicConfig(level=max(level, logging.WARNING), format=LOG_FORMAT, stream=sys.stderr, force=True)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(level)
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
