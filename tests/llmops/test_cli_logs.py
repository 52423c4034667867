"""`llmops logs`: generated rows read back from the result cache (prompt, output, model, time) with filters and
JSON output; the requests table written beside each stored row."""
from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from llmops.cli import main
from llmops.cli_logs import parse_since, prompt_text
from llmops.result_cache import CachedResult, ResultCache


def _run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def logged(fake, tmp_path):
    """A cache holding three generated rows (two prompts of one call, then one more)."""
    cache = tmp_path / "cache"
    for args in (["-p", "invoice for Acme", "-p", "hello world"], ["-p", "a third prompt"]):
        result = CliRunner(env={"LLMOPS_CACHE_DIR": str(cache)}).invoke(main, ["generate", *args])
        assert result.exit_code == 0, result.output
    return cache


def test_logs_lists_newest_first_with_prompt_and_output(logged):
    result = _run("logs", "--cache-dir", logged)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "smollm2-135m-instruct" in lines[0] and "stop" in lines[0]
    assert lines[1] == "  prompt: a third prompt" and lines[2] == "  output: echo: a third prompt"
    assert result.stdout.count("  prompt: ") == 3


def test_logs_json_grep_limit_model_and_since(logged):
    rows = [json.loads(line) for line in _run("logs", "--cache-dir", logged, "--json").stdout.splitlines()]
    assert [r["output"] for r in rows][0] == "echo: a third prompt" and len(rows) == 3
    assert set(rows[0]) >= {"created", "model", "prompt", "output", "finish_reason", "prompt_tokens"}
    grep = _run("logs", "--cache-dir", logged, "--json", "--grep", "ACME").stdout.splitlines()
    assert len(grep) == 1 and "invoice for Acme" in json.loads(grep[0])["prompt"]
    assert len(_run("logs", "--cache-dir", logged, "-n", "1").stdout.splitlines()) == 3
    assert _run("logs", "--cache-dir", logged, "--model", "other-model").stdout == ""
    assert _run("logs", "--cache-dir", logged, "--since", "1h", "--json").stdout.count("\n") == 3
    assert _run("logs", "--cache-dir", logged, "--since", "2999-01-01").stdout == ""


def test_logs_without_a_cache_and_bad_since(tmp_path):
    empty = _run("logs", "--cache-dir", tmp_path / "none")
    assert empty.exit_code == 0 and empty.stdout == "" and "no logged rows" in empty.stderr
    assert not (tmp_path / "none").exists()                     # reading never creates a cache
    bad = _run("logs", "--cache-dir", tmp_path, "--since", "yesterday")
    assert bad.exit_code == 2 and "--since 'yesterday'" in bad.output


def test_parse_since():
    now = 1_000_000.0
    assert parse_since("30m", now) == now - 1800 and parse_since("2d", now) == now - 172800
    assert parse_since("2025-01-31T09:00:00+00:00") == 1738314000.0
    with pytest.raises(click.BadParameter):
        parse_since("soon", now)


@pytest.mark.parametrize("prompt, text", [
    ("plain", "plain"), (["Q: ", {"data": "x"}], "Q: x"),
    ([{"role": "system", "content": ["be brief"]}, {"role": "user", "content": [{"data": "hi"}]}],
     "system: be brief\nuser: hi"),
])
def test_prompt_text(prompt, text):
    assert prompt_text(prompt) == text


def test_requests_are_stored_with_their_rows_and_old_rows_are_not_listed(tmp_path):
    cache = ResultCache(tmp_path)
    row = CachedResult("out", "stop", 3, 1)
    cache.put_many([("old", row)])
    cache.put_many([("new", row), ("err", CachedResult("", "error", 0, 0))],
                   about={"new": ("m", ["hi ", {"data": "there"}]), "err": ("m", "x")})
    entries = list(cache.log_entries())
    assert [e["key"] for e in entries] == ["new"] and entries[0]["prompt"] == ["hi ", {"data": "there"}]
    assert list(cache.log_entries(model="other")) == []


def test_logs_help_has_examples():
    result = _run("logs", "--help")
    assert result.exit_code == 0 and "Examples" in result.stdout and "--since" in result.stdout
