"""The distribution as pip builds and installs it, offline: its name (`llmops-engine`: the name `llmops` on
PyPI belongs to an unrelated project), its extras, the `llmops` command, and the two import packages."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import llmops
from helpers.paths import REPO

EXTRAS = {"report", "ray", "qwen", "test"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of a copy of the project's sources (a build writes into its source folder)."""
    root = tmp_path_factory.mktemp("dist")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    for package in ("engine", "llmops"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", ".",
                    "-w", str(root / "wheels"), "-q"], cwd=src, check=True, capture_output=True, text=True)
    (built,) = (root / "wheels").glob("*.whl")
    return built


def test_the_wheel_names_the_distribution_its_extras_and_the_command(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(info).decode())
        entry_points = z.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert meta["Name"] == llmops.DISTRIBUTION == "llmops-engine" and meta["Version"] == llmops.__version__
    assert EXTRAS <= set(meta.get_all("Provides-Extra"))
    assert "llmops = llmops.cli:main" in entry_points
    assert {n.split("/")[0] for n in names if not n.startswith("llmops_engine-")} == {"engine", "llmops"}
    assert not any("__pycache__" in n or n.startswith(("tests/", "benchmarks/")) for n in names)


def test_the_wheel_installs_offline_and_its_command_runs(wheel, tmp_path):
    prefix = tmp_path / "prefix"
    # --ignore-installed: pip would otherwise uninstall this environment's own copy of the distribution
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--ignore-installed",
                    "--prefix", str(prefix), str(wheel), "-q"], check=True, capture_output=True, text=True)
    (site,) = prefix.glob("lib/python*/site-packages")
    env = {**os.environ, "PYTHONPATH": str(site)}        # the dependencies come from this environment
    done = subprocess.run([str(prefix / "bin" / "llmops"), "--version"], env=env, capture_output=True, text=True,
                          cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == f"llmops {llmops.__version__}"
    where = subprocess.run([sys.executable, "-c", "import llmops, engine; print(llmops.__file__, engine.__file__)"],
                           env=env, capture_output=True, text=True, cwd=tmp_path).stdout
    assert where.count(str(site)) == 2
