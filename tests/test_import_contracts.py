"""The import contracts ("Layers, arrows down": adapters -> llmops.core -> the engine facade), checked on every
test run.

- import-linter's contracts in pyproject.toml (`[tool.importlinter]`): the engine's layers, the engine
  importing no operator-layer library, only the bridge (`llmops.core`) importing `engine`, and only its
  facade (`engine/__init__.py`'s names), no cycle between sibling packages. `lint-imports` runs the same
  check by hand.
- no module-level import cycle anywhere in `engine` or `llmops` (strongly connected components of
  grimp's import graph, function-level imports included): import-linter has no contract for that.
- no import inside a function except of an optional dependency or a deferred one (`DEFERRED`: required, but
  slow to import and needed by few commands), each with a comment saying why; the CLI starts without the
  deferred ones.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]
# What a function may import: optional dependencies (imported where first needed), each line commented.
OPTIONAL = ("polars", "duckdb", "triton", "llguidance", "gguf", "transformers",
            "engine.quant._dequant_triton", "engine.quant._quant_triton", "engine.models._elementwise_triton",
            "engine.models._quant_decode_triton",
            "llmops.polars", "llmops.pipeline.ray_runner", "llmops.ray",
            "llmops.semantic.polars", "llmops.report_html")
# required, but imported where used: the LP solver loads in about a second, which a run whose plan is cached
# (every `llmops run` after the first of a job) never needs
DEFERRED = ("scipy",)


def test_import_linter_contracts_are_kept():
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles():
    graph = grimp.build_graph("engine", "llmops", cache_dir=None)
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def _function_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import inside a function of `path` (`from a import b`: "a.b")."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    found.extend((node.lineno, alias.name) for alias in node.names)
                elif isinstance(node, ast.ImportFrom):
                    found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return found


def test_function_level_imports_are_optional_or_deferred_dependencies_with_a_reason():
    bad = []
    for package in ("engine", "llmops"):
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = path.read_text(encoding="utf-8").splitlines()
            for lineno, module in _function_imports(path):
                optional = any(module == m or module.startswith(m + ".") for m in (*OPTIONAL, *DEFERRED))
                commented = "#" in lines[lineno - 1] or "#" in lines[lineno - 2]
                if not (optional and commented):
                    bad.append(f"{path.relative_to(ROOT)}:{lineno} imports {module}")
    assert bad == []


def test_the_cli_starts_without_the_deferred_modules():
    """`llmops` imports none of DEFERRED until a command needs it (a cached plan needs no LP solver)."""
    code = "import sys, llmops.cli; print(sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[1:])))"
    done = subprocess.run([sys.executable, "-c", code, *DEFERRED], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
