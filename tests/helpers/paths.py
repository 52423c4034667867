"""Where the repository is, for tests that run scripts or read files relative to it."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
