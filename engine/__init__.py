"""llmops' offloading inference engine. Imports no operator-layer library (Polars, DuckDB, Ray, click).

Layers, arrows down (checked by tests/test_import_contracts.py, contracts in pyproject.toml):
`llm` (the facade) -> `calibrate` (machine, measurement, trials, job plans) -> `runtime` (schedule,
executor) -> `policy` (pure decision) -> `storage` -> `models` / `quant` (pure maths); `decoding` (params,
sampling, constraints, prompts, tokenizer, chat) and `util` are leaves used from above.
"""
from engine.decoding.params import Completion, SamplingParams
from engine.llm import LLM
from engine.policy.policy import Policy

__all__ = ["LLM", "Completion", "SamplingParams", "Policy"]
