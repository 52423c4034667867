"""The repository speaks of the product only: no work-process vocabulary, no cited commits.

Scanned: every file git tracks or would track (`git ls-files --cached --others --exclude-standard`), as text,
except binary files, table data (`DATA_SUFFIXES`), the sample data under `sample_data/` (its scripts are
scanned) and this file. A line fails on any of `PROCESS_WORDS` (case-insensitive); a path fails on a process
word in a file or folder name (`PROCESS_NAMES`); a line or path fails on a token of 7-40 hex digits, with
both letters and digits, that names a commit of this repository (`git cat-file`), except inside benchmark
records (`benchmarks/records/**.jsonl`), whose `commit` field is the commit each record measured.
Each failure names file:line and the text matched.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = PurePosixPath("tests/test_vocabulary.py")

PROCESS_WORDS = {
    "stop N": r"\bstops? \d+",
    "lease": r"\blease[sd]?\b",
    "lent": r"\blent\b",
    "the lead": r"\bthe lead\b",
    "device call": r"device call",
    "issue N": r"\bissue #?\d+",
    "review mend": r"review mend",
    "ENVIRONMENT.md": r"ENVIRONMENT\.md",
    "results/h200": r"results/h200",
}
PROCESS_WORDS_RE = re.compile("|".join(f"(?:{p})" for p in PROCESS_WORDS.values()), re.IGNORECASE)
# a process word in a file or folder name: `_stop41`, `call-3`, `issue17`, `lease`, `lent`
PROCESS_NAMES = re.compile(r"(?:^|[^a-z])(?:(?:stop|call|issue)[-_]?\d+|lease[sd]?|lent|review[-_]mend)(?=[^a-z]|$)",
                           re.IGNORECASE)
HEX_TOKEN = re.compile(r"\b[0-9a-f]{7,40}\b")
DATA_SUFFIXES = {".csv", ".tsv", ".parquet", ".arrow", ".feather", ".gguf", ".safetensors", ".bin", ".pt", ".npy",
                 ".npz", ".png", ".jpg", ".jpeg", ".gif", ".pdf", ".ico", ".gz", ".zip", ".whl", ".db", ".duckdb"}
SAMPLE_SCRIPTS = {".py", ".md", ".yaml", ".yml", ".sh"}     # sample_data/'s files that are code or prose
EXCERPT = 120                                            # characters of a failing line shown around the match


def _git(*args: str, stdin: str | None = None) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, input=stdin, capture_output=True, text=True,
                          check=True).stdout


def _has_git() -> bool:
    if shutil.which("git") is None:
        return False
    try:
        return _git("rev-parse", "--is-inside-work-tree").strip() == "true"
    except (subprocess.CalledProcessError, OSError):
        return False


pytestmark = pytest.mark.skipif(not _has_git(), reason="needs git and a git checkout of the repository")


def _paths() -> list[PurePosixPath]:
    """Every file git tracks or would track that exists in the working tree, sorted."""
    listed = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    return sorted({PurePosixPath(p) for p in listed if p and (ROOT / p).is_file()})


def _is_record(path: PurePosixPath) -> bool:
    return path.parts[:2] == ("benchmarks", "records") and path.suffix == ".jsonl"


def _scanned(path: PurePosixPath) -> bool:
    if path == SELF or path.suffix.lower() in DATA_SUFFIXES:
        return False
    return not (path.parts[0] == "sample_data" and path.suffix.lower() not in SAMPLE_SCRIPTS)


def _text(path: PurePosixPath) -> str | None:
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = (ROOT / path).read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _excerpt(line: str, match: re.Match[str]) -> str:
    start = max(0, match.start() - EXCERPT // 2)
    text = line[start:start + EXCERPT].strip()
    return ("..." if start else "") + text + ("..." if start + EXCERPT < len(line) else "")


def _report(hits: list[str], what: str) -> str:
    """The hits, after a count per top-level folder ("." for files at the root)."""
    paths = (PurePosixPath(hit.split(":", 1)[0]) for hit in hits)
    folders = Counter(path.parts[0] if len(path.parts) > 1 else "." for path in paths)
    per_folder = ", ".join(f"{folder}: {n}" for folder, n in sorted(folders.items()))
    return f"{len(hits)} {what} ({per_folder}):\n" + "\n".join(hits)


def vocabulary_hits(path: str, text: str) -> list[str]:
    """'path:line: matched -- excerpt' for every process word on a line of `text`."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for match in PROCESS_WORDS_RE.finditer(line):
            hits.append(f"{path}:{n}: {match.group(0)!r} -- {_excerpt(line, match)}")
    return hits


def commit_shaped(token: str) -> bool:
    """7-40 lower-case hex digits holding both a letter and a digit (a commit id's shape)."""
    return HEX_TOKEN.fullmatch(token) is not None and re.search(r"[a-f]", token) is not None \
        and re.search(r"\d", token) is not None


def hex_tokens(text: str) -> set[str]:
    """The commit-shaped tokens of `text`."""
    return {t for t in HEX_TOKEN.findall(text) if commit_shaped(t)}


def commits_among(tokens: set[str]) -> set[str]:
    """The tokens that name a commit of this repository (one `git cat-file --batch-check` for all)."""
    ordered = sorted(tokens)
    if not ordered:
        return set()
    out = _git("cat-file", "--batch-check", stdin="".join(f"{t}^{{commit}}\n" for t in ordered))
    # one line per token: "<sha> commit <size>", or "<token>^{commit} missing" (or "ambiguous")
    return {t for t, line in zip(ordered, out.splitlines()) if line.split()[1:2] == ["commit"]}


@pytest.mark.parametrize("line, hit", [
    ("the decode step's clock (stop 39's StepClock)", True),
    ("Made for Stop 36's first run", True),
    ("`benchmarks/link_speed.py`, stops 53 and 54", True),
    ("two calls of one lease", True),
    ("on the lent H200's 16-core host", True),
    ("The lead commits them", True),
    ("H200, one device call, throughput_moe.jsonl", True),
    ("issue #17's matrix; Issue 4", True),
    ("Review mend: tracks what it returns", True),
    ("the host's rates (ENVIRONMENT.md)", True),
    ("benchmarks/results/h200/README.md", True),
    ("a stop string ends the row; stop=['\\n']", False),
    ("a view when the leading dims fold", False),
    ("release the lease-free buffer", True),
    ("the buffer is released; a lentil", False),
    ("tissue 4 of the issues", False),
])
def test_process_words_are_recognised(line: str, hit: bool) -> None:
    assert bool(vocabulary_hits("f.py", line)) is hit


@pytest.mark.parametrize("name, hit", [
    ("gpu_tests_stop56.log", True), ("job_paths_moe_stop41_call4.log", True), ("issue-17.md", True),
    ("lease_notes.md", True), ("stop_strings.py", False), ("test_calls.py", False), ("release.py", False),
])
def test_process_names_are_recognised(name: str, hit: bool) -> None:
    assert bool(PROCESS_NAMES.search(name)) is hit


def test_hex_tokens_need_letters_and_digits() -> None:
    text = "at 1b9753f, before af18a83; 1234567 deadbeef 0x1f2e3d4 " + "ab12" * 16
    assert hex_tokens(text) == {"1b9753f", "af18a83"}


def test_commits_are_resolved_by_git() -> None:
    head = _git("rev-parse", "--short=9", "HEAD").strip()
    assert commits_among({head, "fffffff0"}) == {head}


def test_no_process_vocabulary() -> None:
    hits = []
    for path in _paths():
        text = _text(path) if _scanned(path) else None
        if text is not None:
            hits += vocabulary_hits(str(path), text)
    assert not hits, _report(hits, "lines use work-process vocabulary")


def test_no_process_words_in_file_names() -> None:
    hits = [f"{path}:0: {m.group(0)!r} in the path" for path in _paths()
            if (m := PROCESS_NAMES.search(str(path)))]
    assert not hits, _report(hits, "paths carry work-process words")


def test_no_commit_cited() -> None:
    found: list[tuple[str, str, str]] = []              # (where, token, excerpt)
    for path in _paths():
        found += [(f"{path}:0", t, "in the path") for t in hex_tokens(str(path))]
        text = _text(path) if _scanned(path) and not _is_record(path) else None
        for n, line in enumerate((text or "").splitlines(), 1):
            found += [(f"{path}:{n}", m.group(0), _excerpt(line, m)) for m in HEX_TOKEN.finditer(line)
                      if commit_shaped(m.group(0))]
    commits = commits_among({token for _, token, _ in found})
    hits = [f"{where}: commit {token} -- {excerpt}" for where, token, excerpt in found if token in commits]
    assert not hits, _report(hits, "lines or paths cite a commit")
