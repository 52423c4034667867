"""`llmops logs`: browse what the result cache holds: the prompts generated, their outputs, model and time.

Every generated row is stored with its request (`llmops.result_cache`: model name, rendered prompt, time), so
the cache doubles as a log of what was asked. Newest first; filters: `--model`, `--since` (a duration such as
`30m`, `2h`, `7d`, or an ISO date / time), `--grep` (case-insensitive, in the prompt or the output),
`--limit`. `--json` prints one JSON object per line. Reading never changes the cache; a folder without a cache
prints nothing. Exit 2 for a bad option.
"""
from __future__ import annotations

import json
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from llmops.cli_common import note
from llmops.result_cache import ResultCache, default_cache_dir

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(value: str, now: float | None = None) -> float:
    """Epoch seconds from a duration before `now` (`30m`, `2h`, `7d`, `1w`) or an ISO date / date-time (local
    time unless it names a zone). click.BadParameter naming the value otherwise."""
    found = _DURATION.match(value)
    if found:
        return (time.time() if now is None else now) - float(found.group(1)) * _SECONDS[found.group(2)]
    try:
        return datetime.fromisoformat(value.strip()).timestamp()
    except ValueError:
        raise click.BadParameter(f"--since {value!r}: expected a duration such as 30m, 2h, 7d or an ISO date such "
                                 "as 2025-01-31 or 2025-01-31T09:00") from None


def prompt_text(prompt: Any) -> str:
    """A stored prompt for people: chat messages as `role: text` lines, parts joined, a string as is."""
    def parts(content: Any) -> str:
        if isinstance(content, str):
            return content
        return "".join(p if isinstance(p, str) else str(p.get("data", "")) for p in content)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) and "role" in prompt[0]:
        return "\n".join(f"{m.get('role')}: {parts(m.get('content', ''))}" for m in prompt)
    if isinstance(prompt, list) and all(isinstance(p, (str, dict)) for p in prompt):
        return parts(prompt)
    return json.dumps(prompt, ensure_ascii=False)


def entries(cache_dir: Path, *, model: str | None, since: float | None, grep: str | None,
            limit: int) -> list[dict[str, Any]]:
    """The newest `limit` logged rows of the cache in `cache_dir` that pass the filters (none without a cache)."""
    if not (cache_dir / "results.sqlite").is_file():
        return []
    cache = ResultCache(cache_dir)
    needle = grep.lower() if grep else None
    out = []
    try:
        for entry in cache.log_entries(model=model, since=since):
            text = prompt_text(entry["prompt"])
            if needle is not None and needle not in text.lower() and needle not in (entry["text"] or "").lower():
                continue
            out.append({"created": datetime.fromtimestamp(entry["created"]).isoformat(timespec="seconds"),
                        "model": entry["model"], "prompt": text, "output": entry["text"],
                        "finish_reason": entry["finish_reason"], "prompt_tokens": entry["prompt_tokens"],
                        "completion_tokens": entry["completion_tokens"], "confidence": entry["confidence"],
                        "key": entry["key"]})
            if len(out) >= limit:
                break
    finally:
        cache.close()
    return out


def _indent(text: str) -> str:
    return text.replace("\n", "\n    ")


@click.command("logs")
@click.option("--model", "-m", help="Only rows of this model (the name the run used).")
@click.option("--since", help="Only rows stored since a duration ago (30m, 2h, 7d) or an ISO date / time.")
@click.option("--grep", help="Only rows whose prompt or output contains this text (case-insensitive).")
@click.option("--limit", "-n", type=click.IntRange(min=1), default=20, show_default=True, help="At most N rows.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="The result cache folder (default: $LLMOPS_CACHE_DIR, else ~/.cache/llmops/results).")
def logs_cmd(model: str | None, since: str | None, grep: str | None, limit: int, as_json: bool,
             cache_dir: Path | None) -> None:
    """Show generated rows from the result cache, newest first: time, model, prompt and output.

    \b
    Examples:
      llmops logs                            # the last 20 rows
      llmops logs --since 2h --grep invoice  # rows of the last two hours mentioning "invoice"
      llmops logs -m smollm2-135m-instruct -n 5 --json
    """
    folder = cache_dir if cache_dir is not None else default_cache_dir()
    found = entries(folder, model=model, since=parse_since(since) if since else None, grep=grep, limit=limit)
    if not found:
        note(f"no logged rows in {folder}" + (" matching the filters" if model or since or grep else ""))
    for e in found:
        if as_json:
            click.echo(json.dumps(e, ensure_ascii=False))
            continue
        tokens = f"{e['prompt_tokens']}+{e['completion_tokens']} tokens"
        click.echo(f"{e['created']}  {e['model']}  {e['finish_reason']}  {tokens}")
        click.echo(f"  prompt: {_indent(e['prompt'])}")
        click.echo(f"  output: {_indent(e['output'] or '')}")
