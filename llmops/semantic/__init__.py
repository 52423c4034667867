"""Semantic operators beyond `llm_map`: `llm_filter`, `llm_reduce`, `resolve` (entity resolution),
`llm_join` (matching two tables), `llm_topk` (ranking), `llm_extract` (quoted fields), `embed` / `sim_join`
(embeddings) and `split` / `gather` (long documents); the LLM ones take `validate` rules (`llmops.validate`:
rules on any LLM output, with bounded retries, which `llm_map` takes too).

Arrow-level functions live here, one operator per module (`filter`, `reduce`, `resolve`, `join`, `topk`,
`extract`, `embed`, `split`) over shared pure helpers (`blocking`, `embed_blocking`, `components`) and the pair
comparison (`compare`); every LLM call goes through `llmops.core.map_table` as one job per operator step
(`options.Llm`), every embedding through `llmops.core.embed_texts`. Adapters: `llmops.semantic.polars`
(`llmops.llm_filter`, `llmops.llm_join`, ...), `llmops.semantic.duckdb` (functions over relations, a boolean
`llm_filter` SQL macro) and the pipeline steps (`llmops.pipeline.semantic_spec`, `operator_spec`). Nothing here
imports Polars.
"""
from llmops.semantic.blocking import Blocking, candidate_pairs, cross_candidate_pairs, pair_recall
from llmops.semantic.components import components, pair_scores
from llmops.semantic.embed import embed_table, sim_join_table
from llmops.semantic.embed_blocking import EmbeddingBlocking
from llmops.semantic.extract import ExtractReport, llm_extract_table
from llmops.semantic.filter import llm_filter_table
from llmops.semantic.join import JoinReport, llm_join_table
from llmops.semantic.options import Llm
from llmops.semantic.reduce import ReduceReport, llm_reduce_table
from llmops.semantic.resolve import ResolveReport, resolve_table
from llmops.semantic.split import gather_table, split_table
from llmops.semantic.topk import TopKReport, llm_topk_table
from llmops.validate import RuleError, run_checked

__all__ = ["Blocking", "EmbeddingBlocking", "ExtractReport", "JoinReport", "Llm", "ReduceReport", "ResolveReport",
           "RuleError", "TopKReport", "candidate_pairs", "components", "cross_candidate_pairs", "embed_table",
           "gather_table", "llm_extract_table", "llm_filter_table", "llm_join_table", "llm_reduce_table",
           "llm_topk_table", "pair_recall", "pair_scores", "resolve_table", "run_checked", "sim_join_table",
           "split_table"]
