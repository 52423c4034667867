"""`llmops generate` with the prompt as an argument (or `--prompt`), beside files and stdin, on the fake engine."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from llmops.cli import main
from llmops.cli_generate import split_input


def _run(*args: str, input: str | None = None):
    return CliRunner().invoke(main, ["generate", *map(str, args)], input=input)


def test_prompt_as_argument(fake):
    result = _run("Say hi there", "--no-cache")
    assert result.exit_code == 0, result.output
    assert result.stdout == "echo: Say hi there\n"


def test_prompt_with_model_tokens_and_choices(fake):
    result = _run("Is this spam? Win a free cruise", "--choices", "yes,no", "-m", "some-model", "--max-new-tokens", "2",
                  "--no-cache", "--jsonl")
    row = json.loads(result.stdout)
    assert result.exit_code == 0 and row["output"] in ("yes", "no") and row["row"] == 0
    assert fake.last_params.choices == ("yes", "no") and fake.last_params.max_new_tokens == 2


def test_prompt_with_schema_and_template(fake):
    result = _run("an invoice for 12 dollars", "--schema", '{"total": "number"}', "--no-cache")
    assert result.exit_code == 0 and "total" in json.loads(result.stdout)
    wrapped = _run("hello", "-t", "Translate to French: {prompt}", "--no-cache")
    assert wrapped.stdout == "echo: Translate to French: hello\n"


def test_repeated_prompt_option(fake):
    result = _run("-p", "first one", "-p", "second one", "--jsonl", "--no-cache")
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["output"] for r in rows] == ["echo: first one", "echo: second one"]


def test_existing_files_and_stdin_still_read_as_input(fake, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n")
    assert _run(prompts, "--no-cache").stdout == "echo: one\necho: two\n"
    assert _run("--no-cache", input="piped\n").stdout == "echo: piped\n"


@pytest.mark.parametrize("args, message", [
    (["notes.txt"], "no such file: notes.txt"),
    (["data.csv", "-p", "hi"], "no such file"),
    (["some prompt", "-p", "hi"], "not both"),
])
def test_ambiguous_input_exits_2(fake, args, message):
    result = _run(*args)
    assert result.exit_code == 2 and message in result.output


@pytest.mark.parametrize("value, prompts, expected", [
    ("-", (), ("-", None)), ("Name three colours", (), ("-", ["Name three colours"])),
    ("-", ("a", "b"), ("-", ["a", "b"])), ("hello.", (), ("-", ["hello."])),
])
def test_split_input(value, prompts, expected):
    assert split_input(value, prompts) == expected
