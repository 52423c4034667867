"""CLI conventions through click's runner on the fake engine: --version, -v/-q and logging, --set
validation, `llmops models` capabilities, hints on the main help's examples."""
from __future__ import annotations

import logging
from importlib import metadata
from pathlib import Path

import pytest
from click.testing import CliRunner
from fake_engine import FakeLLM

import llmops
from llmops import engines
from llmops.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake() -> FakeLLM:
    engine = FakeLLM(block_size=2)
    previous = engines.set_factory(lambda model, **settings: engine)
    yield engine
    engines.set_factory(previous)


def _run(*args: str, input: str | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def test_version_matches_the_package_metadata():
    result = _run("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"llmops {llmops.__version__}"
    assert _run("-V").stdout == result.stdout
    assert metadata.version("llmops") == llmops.__version__
    text = (ROOT / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in text and (ROOT / "LICENSE").exists()


def test_verbose_and_quiet_set_logging_and_diagnostics(fake):
    result = _run("-q", "generate", "--no-cache", input="hello\n")
    assert result.exit_code == 0 and result.stdout == "echo: hello\n" and result.stderr == ""
    assert logging.getLogger().level == logging.ERROR
    loud = _run("generate", "--no-cache", input="hello\n")
    assert "rows in" in loud.stderr and logging.getLogger().level == logging.WARNING
    _run("-v", "generate", "--no-cache", input="hello\n")
    assert logging.getLogger().level == logging.INFO
    _run("-vv", "generate", "--no-cache", input="hello\n")
    assert logging.getLogger().level == logging.DEBUG
    assert _run("-q", "generate", "nope.txt").exit_code == 2    # errors still reach stderr under -q
    assert "nope.txt" in _run("-q", "generate", "nope.txt").stderr
