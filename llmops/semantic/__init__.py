"""Semantic operators beyond `llm_map`: `llm_filter`, `llm_reduce`, `resolve` (entity resolution) and
`llm_join` (matching two tables); every one takes `validate` rules (`llmops.validate`: rules on any LLM
output, with bounded retries, which `llm_map` takes too).

Arrow-level functions live here, one operator per module (`filter`, `reduce`, `resolve`, `join`) over
shared pure helpers (`blocking`, `components`) and the pair comparison (`compare`); every
LLM call goes through `llmops.core.map_table` as one job per operator step (`options.Llm`). Adapters:
`llmops.semantic.polars` (`llmops.llm_filter`, `llmops.llm_join`, `llmops.resolve`, `llmops.llm_reduce`),
`llmops.semantic.duckdb` (functions over relations, a boolean `llm_filter` SQL macro) and the pipeline steps
`llm_filter`, `llm_reduce`, `resolve`, `llm_join` (`llmops.pipeline.semantic_spec`). Nothing here imports
Polars.
"""
from llmops.semantic.blocking import Blocking, candidate_pairs, cross_candidate_pairs, pair_recall
from llmops.semantic.components import components, pair_scores
from llmops.semantic.filter import llm_filter_table
from llmops.semantic.join import JoinReport, llm_join_table
from llmops.semantic.options import Llm
from llmops.semantic.reduce import ReduceReport, llm_reduce_table
from llmops.semantic.resolve import ResolveReport, resolve_table
from llmops.validate import RuleError, run_checked

__all__ = ["Blocking", "JoinReport", "Llm", "ReduceReport", "ResolveReport", "RuleError", "candidate_pairs",
           "components", "cross_candidate_pairs", "llm_filter_table", "llm_join_table", "llm_reduce_table",
           "pair_recall", "pair_scores", "resolve_table", "run_checked"]
