"""Declarative pipelines: a YAML file says `source -> steps -> sink`; `llmops run FILE` executes it.

    from llmops.pipeline import load_pipeline, run_pipeline
    result = run_pipeline(load_pipeline("pipelines/extract_invoices.yaml"), limit=20)

Modules: `spec` (the pydantic schema), `load` (YAML with line numbers, errors naming file/line/key),
`sources`, `steps`, `sinks` (staged then published atomically), `runner` (streaming execution),
`plan` (dry run), `oneoff` (what `llmops generate` / `llmops models` do).
"""
from llmops.pipeline.load import PipelineError, dump_pipeline, load_pipeline
from llmops.pipeline.runner import RunResult, run_pipeline
from llmops.pipeline.spec import Pipeline

__all__ = ["Pipeline", "PipelineError", "RunResult", "dump_pipeline", "load_pipeline", "run_pipeline"]
