"""Run the steps of `operator_spec` (`llm_topk`, `llm_extract`, `embed`, `sim_join`, `split`, `gather`) on the whole
current table with the pipeline's model, engine settings and result cache (called by
`llmops.pipeline.semantic_steps.run_semantic`, which names the step in errors and adds up the figures).

`run_operator_step(step, table, ctx)` returns the new table, the step's `RunSummary` (its LLM calls) and the
operator's report. `split` by tokens loads the model's tokenizer only when the table has rows.
"""
from __future__ import annotations

from typing import Any

import pyarrow as pa

from llmops.pipeline.operator_spec import (EmbedStep, GatherStep, LlmExtractStep, LlmTopKStep, ModelOnly,
                                           SimJoinStep, SplitStep)
from llmops.pipeline.steps import run_sql
from llmops.semantic.embed import embed_table, sim_join_table
from llmops.semantic.extract import llm_extract_table
from llmops.semantic.options import Llm
from llmops.semantic.split import gather_table, model_tokenizer, split_table
from llmops.semantic.topk import llm_topk_table
from llmops.summary import RunSummary


def step_llm(cfg: Any, ctx: Any) -> Llm:
    """The `Llm` of a step: its model (else the pipeline's), generation settings (a generating step's) and the
    pipeline's engine settings, result cache, progress and engine."""
    generation = {} if isinstance(cfg, ModelOnly) else cfg.generation()
    rules = () if isinstance(cfg, ModelOnly) else tuple(cfg.validate_)
    attempts = 2 if isinstance(cfg, ModelOnly) else cfg.max_attempts
    return Llm(model=cfg.model or ctx.pipeline.model,
               generation={**generation, "engine_settings": ctx.pipeline.engine.llm_kwargs()},
               validate=rules, max_attempts=attempts, cache_dir=ctx.cache_dir, progress=ctx.progress,
               engine=ctx.engine)


def run_operator_step(step: Any, table: pa.Table, ctx: Any) -> tuple[pa.Table, RunSummary, dict[str, Any]]:
    """(new table, summary, report) of one operator step (see module docstring)."""
    cfg = getattr(step, next(iter(type(step).model_fields)))
    llm = step_llm(cfg, ctx)
    if isinstance(step, LlmTopKStep):
        out, rep = llm_topk_table(table, cfg.template, cfg.k, llm, rank=cfg.rank, seed=cfg.seed)
        report = rep.to_dict()
    elif isinstance(step, LlmExtractStep):
        out, rep = llm_extract_table(table, cfg.column, cfg.fields, llm, quotes=cfg.quotes, output=cfg.output,
                                     gleaning=cfg.gleaning)
        report = rep.to_dict()
    elif isinstance(step, EmbedStep):
        out = embed_table(table, cfg.column, llm, output=cfg.output)
        report = {"rows": out.num_rows, "errors": out.num_rows - out.column(f"{cfg.output}_error").null_count}
    elif isinstance(step, SimJoinStep):
        right = run_sql(cfg.right, pa.table({"_": [None]}), label="sim_join.right")
        out = sim_join_table(table, right, llm, left_on=cfg.left_on, right_on=cfg.right_on, k=cfg.k,
                             threshold=cfg.threshold, suffix=cfg.suffix)
        report = {"left_rows": table.num_rows, "right_rows": right.num_rows, "pairs": out.num_rows}
    elif isinstance(step, SplitStep):
        tokenizer = model_tokenizer(llm) if cfg.unit == "tokens" and table.num_rows else None
        out = split_table(table, cfg.column, chunk_size=cfg.chunk_size, overlap=cfg.overlap, unit=cfg.unit,
                          id_column=cfg.id_column, tokenizer=tokenizer)
        report = {"documents": table.num_rows, "chunks": out.num_rows}
    elif isinstance(step, GatherStep):
        constraint = {"schema": cfg.schema_, "choices": tuple(cfg.choices) if cfg.choices else None,
                      "max_new_tokens": cfg.max_new_tokens} if cfg.template is not None else {}
        out, rep = gather_table(table, cfg.column, by=cfg.by, order=cfg.order, output=cfg.output,
                                separator=cfg.separator, template=cfg.template, llm=llm, **constraint)
        report = {"documents": out.num_rows, **(rep.to_dict() if rep is not None else {})}
    else:
        raise TypeError(f"not an operator step: {step!r}")
    return out, llm.summary, report
