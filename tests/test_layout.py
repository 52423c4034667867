"""The test suite's layout: test modules sit in the folder of the layer they test, and share code only through
fixtures (conftest.py) and helper modules (tests/helpers/, imported as `helpers.<module>`).

- No module under tests/ imports a test module (`test_*`), `conftest` or `tests.*`: not at module level, not
  inside a function, not in a script it runs in a subprocess (a string holding such an import line).
- The only test modules directly in tests/ are the cross-cutting ones (`TOP_LEVEL`); every other one sits
  under a layer folder (`LAYERS`), and no two share a file name (pytest imports them by their base names).
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

SELF = Path(__file__).resolve()
TESTS = SELF.parent
TOP_LEVEL = {"test_import_contracts.py", "test_layout.py", "test_readme.py", "test_vocabulary.py"}
LAYERS = {"engine", "llmops", "gpu", "benchmarks"}
# a line of a script held in a string (run in a subprocess) importing a test module, conftest or tests.*
SCRIPT_IMPORT = re.compile(r"^\s*(?:from|import)\s+(?:test_\w*|conftest|tests)\b", re.MULTILINE)


def _python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _forbidden(module: str) -> bool:
    """A test module (`test_*`), `conftest`, or the tests package itself (`tests`, `tests.*`)."""
    first = module.split(".")[0]
    return first.startswith("test_") or first in ("conftest", "tests")


def _bad_imports(path: Path, root: Path, strings: bool = True) -> list[str]:
    """`file:line: the import` for each forbidden import in `path` (named relative to `root`), in code and,
    with `strings`, in string constants (scripts run in a subprocess); in line order."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if _forbidden(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _forbidden(node.module):
            found.append((node.lineno, f"from {node.module} import ..."))
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [(node.lineno, f"in a string: {m.group(0).strip()} ...")
                      for m in SCRIPT_IMPORT.finditer(node.value)]
    return [f"{path.relative_to(root)}:{line}: {text}" for line, text in sorted(found)]


def test_no_module_imports_a_test_module_or_conftest():
    # this file's strings hold its own sample of forbidden imports (the last test)
    bad = [line for path in _python_files() for line in _bad_imports(path, TESTS.parent, strings=path != SELF)]
    assert not bad, ("shared code goes in a fixture (tests/conftest.py) or a helper module (tests/helpers/, "
                     "imported as `from helpers.<module> import ...`):\n" + "\n".join(bad))


def test_test_modules_sit_in_their_layer_folder():
    misplaced = []
    for path in _python_files():
        if not path.name.startswith("test_"):
            continue
        rel = path.relative_to(TESTS)
        if len(rel.parts) == 1:
            if rel.name not in TOP_LEVEL:
                misplaced.append(f"tests/{rel}: directly in tests/ (only {', '.join(sorted(TOP_LEVEL))} are)")
        elif rel.parts[0] not in LAYERS:
            misplaced.append(f"tests/{rel}: not under a layer folder ({', '.join(sorted(LAYERS))})")
    assert not misplaced, "\n".join(misplaced)


def test_test_module_names_are_unique():
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in _python_files():
        if path.name.startswith("test_"):
            by_name[path.name].append(str(path.relative_to(TESTS.parent)))
    clashes = [f"{name}: {', '.join(paths)}" for name, paths in sorted(by_name.items()) if len(paths) > 1]
    assert not clashes, "test modules sharing a file name (pytest imports them by base name):\n" + "\n".join(clashes)


def test_the_import_check_flags_every_forbidden_form(tmp_path):
    """Module level, inside a function and in a subprocess script are flagged; a helper import is not."""
    sample = tmp_path / "test_sample.py"
    sample.write_text("import conftest\n"
                      "from test_executor import run_policy\n"
                      "import tests.engine.test_llm\n"
                      "from helpers.greedy_runs import make_prompts\n"
                      "def f():\n"
                      "    from conftest import fake\n"
                      "CODE = 'import sys; from helpers.paths import REPO'\n"
                      "SCRIPT = '''\nimport sys\nfrom test_durability import write_rows\n'''\n")
    assert _bad_imports(sample, tmp_path) == [
        "test_sample.py:1: import conftest", "test_sample.py:2: from test_executor import ...",
        "test_sample.py:3: import tests.engine.test_llm", "test_sample.py:6: from conftest import ...",
        "test_sample.py:8: in a string: from test_durability ..."]
