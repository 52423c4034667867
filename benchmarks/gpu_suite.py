"""Run a named GPU suite (benchmarks/suites.toml) on this tree and, with --ref, right after on another commit.

    python benchmarks/gpu_suite.py --list
    python benchmarks/gpu_suite.py --suite correctness --suite kernels
    python benchmarks/gpu_suite.py --suite headline --ref COMMIT           # this tree, then COMMIT
    python benchmarks/gpu_suite.py --suite headline --step 1               # its first command only
    python benchmarks/gpu_suite.py --prepare-ref COMMIT                    # for a GPU host without git

Each command runs from the root of its tree through bash, one after another, under one LLMOPS_RUN_ID (shared
by every record of the invocation, both trees included), with its timeout; a failing or timed-out command is
reported and the suite goes on. The harnesses append their records to LLMOPS_RECORDS_DIR (default: $OUT/records
when $OUT is set, else benchmarks/records/), the same folder for both trees; the runner adds one `gpu_suite`
record per command (its exit status, seconds and the last lines it printed). Nothing is written into the tree
but records: output goes to the terminal.

--ref COMMIT runs the same suite's commands in a tree of COMMIT after this one, with LLMOPS_COMMIT naming it:
benchmarks/.refs/<COMMIT>/ when --prepare-ref wrote it there (`git archive`, for a host that gets a copy of
the working tree without git; carry that folder), else a `git worktree` made for the run and removed after.
COMMIT must have this suite layout (a command whose script the tree lacks is an error naming it). With
`.whl/*.whl` present (e.g. FlexGen's wheel), they are installed into a folder on PYTHONPATH first.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repository root
from benchmarks.common import ROOT, append_jsonl, new_record, new_run_id, record_path, records_dir  # noqa: E402

SUITES_FILE = ROOT / "benchmarks" / "suites.toml"
REFS_DIR = ROOT / "benchmarks" / ".refs"
TAIL_LINES = 15


@dataclass(frozen=True)
class Step:
    command: str
    timeout_s: int


@dataclass(frozen=True)
class Suite:
    name: str
    about: str
    minutes: float
    steps: tuple[Step, ...]


def load_suites(path: Path = SUITES_FILE) -> dict[str, Suite]:
    """Every suite of the TOML file; a malformed entry is a ValueError naming the suite and the field."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    suites = {}
    for name, table in data.items():
        default = table.get("timeout_s", 600)
        steps = []
        for n, entry in enumerate(table.get("commands") or []):
            if isinstance(entry, str):
                entry = {"command": entry}
            if not isinstance(entry, dict) or not isinstance(entry.get("command"), str):
                raise ValueError(f"{path}: suite {name!r}, commands[{n}]: a string or a table with `command`")
            steps.append(Step(" ".join(entry["command"].split()), int(entry.get("timeout_s", default))))
        if not steps:
            raise ValueError(f"{path}: suite {name!r} has no commands")
        suites[name] = Suite(name, table.get("about", ""), float(table.get("minutes", 0)), tuple(steps))
    return suites


def scripts_of(command: str) -> list[str]:
    """The repository files a command runs (`python X.py`, `pytest` paths under tests/)."""
    words = shlex.split(command)
    return [w for w in words if w.endswith(".py") and not w.startswith("-") and "/" in w
            and not w.startswith("/")] + [w for w in words if w.startswith("tests/") and not w.endswith(".py")]


def check_tree(tree: Path, suite: Suite, label: str) -> None:
    """SystemExit naming the first script of `suite` that `tree` lacks."""
    for step in suite.steps:
        for script in scripts_of(step.command):
            if not (tree / script).exists():
                raise SystemExit(f"{label} has no {script}: --ref needs a commit with this suite's layout "
                                 f"(suite {suite.name!r})")


def resolve_commit(commit: str) -> str:
    """The full sha of `commit` (SystemExit naming it when git does not know it)."""
    done = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"--ref {commit}: not a commit of this repository ({done.stderr.strip()})")
    return done.stdout.strip()


def prepare_ref(commit: str) -> Path:
    """benchmarks/.refs/<sha>/: COMMIT's tree written by `git archive`, for a host without git."""
    sha = resolve_commit(commit)
    dest = REFS_DIR / sha
    if dest.exists():
        return dest
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


@contextmanager
def ref_tree(commit: str) -> Iterator[tuple[Path, str]]:
    """(tree, sha) of COMMIT: a prepared benchmarks/.refs/ folder (its name may be a prefix of the sha), else a
    git worktree removed afterwards."""
    prepared = sorted(p for p in REFS_DIR.glob(f"{commit}*") if p.is_dir()) if REFS_DIR.is_dir() else []
    if prepared:
        yield prepared[0], prepared[0].name
        return
    sha = resolve_commit(commit)
    with tempfile.TemporaryDirectory(prefix="llmops-ref-") as tmp:
        tree = Path(tmp) / sha[:12]
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            yield tree, sha
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)


def install_wheels(env: dict[str, str]) -> None:
    """Install `.whl/*.whl` (peers such as FlexGen) into a folder put on PYTHONPATH, when there are any."""
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if not wheels:
        return
    target = Path(tempfile.gettempdir()) / "llmops-suite-site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(target), *map(str, wheels)], check=True)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(target)) if p)


def run_step(step: Step, tree: Path, env: dict[str, str]) -> tuple[int, float, list[str]]:
    """(exit status, seconds, last lines printed) of one command, its output passed through as it comes; 124
    when its timeout ended it (SIGTERM to its process group, SIGKILL 30 s later)."""
    tail: list[str] = []

    def pump(stream: Any) -> None:
        for line in stream:
            sys.stdout.write(line)
            tail.append(line.rstrip("\n"))
            del tail[:-TAIL_LINES]

    start = time.perf_counter()
    proc = subprocess.Popen(["bash", "-c", step.command], cwd=tree, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    reader = threading.Thread(target=pump, args=(proc.stdout,), daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=step.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        code = 124
    reader.join(timeout=5)
    return code, time.perf_counter() - start, list(tail)


def run_suite(suite: Suite, tree: Path, env: dict[str, str], commit: str | None) -> list[int]:
    """Every step of `suite` in `tree`, one `gpu_suite` record each; the exit statuses."""
    codes = []
    for n, step in enumerate(suite.steps, 1):
        print(f"\n[gpu_suite] {suite.name} {n}/{len(suite.steps)} ({tree.name}): {step.command}", flush=True)
        code, seconds, tail = run_step(step, tree, env)
        codes.append(code)
        record = new_record("gpu_suite", suite.name, None, commit=commit, run_id=env["LLMOPS_RUN_ID"])
        record.update(command=step.command, returncode=code, seconds=round(seconds, 1), timeout_s=step.timeout_s,
                      tree="this tree" if tree == ROOT else "ref", output_tail=tail)
        append_jsonl(record_path("gpu_suite"), record)
        print(f"[gpu_suite] exit {code} after {seconds:.0f} s", flush=True)
    return codes


def base_env() -> dict[str, str]:
    """The environment every command gets: `python` is this interpreter, one run id, the records folder as an
    absolute path, unbuffered output, NVLink multicast off for multi-GPU runs."""
    env = dict(os.environ)
    bin_dir = Path(tempfile.gettempdir()) / f"llmops-suite-bin-{zlib.crc32(sys.executable.encode()):08x}"
    if not (bin_dir / "python").exists():                             # `python` in a command: this interpreter
        bin_dir.mkdir(exist_ok=True)
        (bin_dir / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        (bin_dir / "python").chmod(0o755)
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env.setdefault("LLMOPS_RUN_ID", new_run_id())
    env["LLMOPS_RECORDS_DIR"] = str(records_dir().resolve())
    env.update(PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", action="append", default=[], help="a suite of benchmarks/suites.toml (repeatable)")
    ap.add_argument("--ref", default=None, help="also run the suites on this commit, after this tree")
    ap.add_argument("--prepare-ref", default=None, metavar="COMMIT",
                    help="write COMMIT's tree to benchmarks/.refs/<sha>/ for a host without git, then exit")
    ap.add_argument("--list", action="store_true", help="print the suites and their commands, then exit")
    ap.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    ap.add_argument("--step", type=int, action="append", default=[], metavar="N",
                    help="only the suite's N-th command (from 1; repeatable): a suite longer than the time a "
                         "host is available runs in parts")
    args = ap.parse_args(argv)
    suites = load_suites()
    if args.prepare_ref:
        print(prepare_ref(args.prepare_ref))
        return 0
    if args.list or not args.suite:
        for suite in suites.values():
            print(f"{suite.name} (~{suite.minutes:g} min): {suite.about}")
            for step in suite.steps:
                print(f"    [{step.timeout_s} s] {step.command}")
        return 0 if args.list else 2
    unknown = [name for name in args.suite if name not in suites]
    if unknown:
        ap.error(f"unknown suite(s) {unknown}; choose from {', '.join(suites)}")
    chosen = [suites[name] for name in args.suite]
    if args.step:
        for suite in chosen:
            outside = [n for n in args.step if not 1 <= n <= len(suite.steps)]
            if outside:
                ap.error(f"--step {outside}: suite {suite.name!r} has commands 1-{len(suite.steps)}")
        chosen = [replace(suite, steps=tuple(suite.steps[n - 1] for n in sorted(set(args.step))))
                  for suite in chosen]
    if args.dry_run:
        for suite in chosen:
            print("\n".join(f"{suite.name}: {step.command}" for step in suite.steps))
        return 0
    env = base_env()
    install_wheels(env)
    print(f"[gpu_suite] run {env['LLMOPS_RUN_ID']}, records in {env['LLMOPS_RECORDS_DIR']}", flush=True)
    codes = [c for suite in chosen for c in run_suite(suite, ROOT, env, None)]
    if args.ref:
        with ref_tree(args.ref) as (tree, sha):
            for suite in chosen:
                check_tree(tree, suite, f"commit {sha}")
            ref_env = {**env, "LLMOPS_COMMIT": sha}
            codes += [c for suite in chosen for c in run_suite(suite, tree, ref_env, sha)]
    failed = sum(code != 0 for code in codes)
    print(f"\n[gpu_suite] {len(codes) - failed} of {len(codes)} commands succeeded", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
