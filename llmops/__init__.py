"""llmops: run an open LLM over every row of a table (Polars, DuckDB, pipelines) with the `engine` below.

Eager exports are Arrow-only (`MapSpec`, `map_table`, ...); `llm_map` (Polars) is imported on first use so
that `import llmops` works without Polars. DuckDB support lives in `llmops.duckdb` (`register`).
"""
from __future__ import annotations

from typing import Any

from llmops.core import (MapRun, MapSpec, RunSummary, last_summaries, last_summary, map_table, map_table_ordered,
                         output_schema, output_type)
from llmops.templates import TemplateError

__version__ = "0.1.0"   # the package version (pyproject.toml reads it from here)
DISTRIBUTION = "llmops-engine"   # the name pip installs (pyproject.toml [project] name); imports say `llmops`


def install_hint(extra: str) -> str:
    """How to install one of the distribution's extras, published or from a checkout."""
    return f'pip install "{DISTRIBUTION}[{extra}]" (from a checkout: pip install -e ".[{extra}]")'

__all__ = ["MapRun", "MapSpec", "RunSummary", "TemplateError", "last_summaries", "last_summary", "llm_map",
           "map_table", "map_table_ordered", "output_schema", "output_type"]
SEMANTIC = ("llm_filter", "llm_join", "resolve", "llm_reduce", "llm_topk", "llm_extract", "embed", "sim_join",
            "split", "gather")  # llmops.semantic.polars, imported on first use


def __getattr__(name: str) -> Any:
    if name == "llm_map":
        from llmops.polars import llm_map  # optional dependency: Polars (`import llmops` works without it)

        return llm_map
    if name in SEMANTIC:
        from llmops.semantic import polars as semantic_polars  # optional dependency: Polars

        return getattr(semantic_polars, name)
    raise AttributeError(f"module 'llmops' has no attribute {name!r}")
